"""Checks at forward time that stop a plan or a call which would otherwise train silently wrong.

Two mistakes cannot be seen from module types and sizes, only from what a module is given:

- a head-sharded activation (the output of a `colwise` projection: this rank's heads) handed to a
  `replicate` module. `replicate` assumes every TP rank holds the same activation; on per-rank
  heads (Qwen3's `q_norm` / `k_norm`) its weight gradient would be neither one rank's nor the sum.
  `colwise` tags its local output, and a `replicate` module refuses a tagged input, or a view of
  one (`q_proj(x).view(B, S, -1, head_dim)` keeps the tag on its `_base`). Only eager forwards are
  checked: inside `torch.compile` nothing is tagged.
- under sequence parallel, an argument of a region opener derived from the *local* sequence shard
  (transformers builds RoPE `(cos, sin)`, `position_ids` and the causal mask from the embedding's
  output, which is a shard): inside the region the sequence is gathered, so it must cover the
  full sequence.
"""

import torch

_LOCAL_HEADS = "_plait_local_heads"


def mark_local_heads(y: torch.Tensor) -> torch.Tensor:
    """Tag a `colwise` output as this rank's shard of heads / hidden units (eager only).

    `to_local()` returns a view of the projection's fresh output, and a view of a view records the
    root as its `_base`: both are tagged."""
    if isinstance(y, torch.Tensor) and not torch.compiler.is_compiling():
        for t in (y, y._base):
            if t is not None:
                setattr(t, _LOCAL_HEADS, True)
    return y


def holds_local_heads(x: torch.Tensor) -> bool:
    """True for a tagged `colwise` output or a view of one (a view keeps its base alive as `_base`)."""
    if torch.compiler.is_compiling() or not isinstance(x, torch.Tensor):
        return False
    return getattr(x, _LOCAL_HEADS, False) or getattr(x._base, _LOCAL_HEADS, False)


def refuse_local_heads(entry: str, plan_string: str, inputs: tuple) -> None:
    """Raise if a replicated-weights style is given a `colwise` output (this rank's heads)."""
    if any(holds_local_heads(x) for x in inputs):
        raise ValueError(
            f"plan entry {entry!r}: {plan_string!r} got the output of a 'colwise' projection (this rank's heads), "
            "but it assumes an activation every TP rank holds whole, so its weight gradient would be wrong; "
            f"mark {entry!r} 'head_norm' (a norm or other replicated-weight module applied to each local head)."
        )


def check_full_sequence(entry: str, hidden_S: int, full_S: int, args: tuple, kwargs: dict) -> None:
    """Under SP the region gathers `hidden_S` tokens into `full_S`: an argument with a dim of the local
    length and none of the full one was derived from the shard (RoPE, position ids, a mask)."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
    for name, value in named:
        for tensor in _tensors(value):
            if tensor.ndim >= 2 and hidden_S in tensor.shape and full_S not in tensor.shape:
                raise ValueError(
                    f"plan entry {entry!r}: under sequence parallel the region gathers the sequence to {full_S} "
                    f"tokens, but {name} has shape {tuple(tensor.shape)}, of the local shard's {hidden_S}: the model "
                    f"derived it from the sharded hidden state. Pass full-sequence position_ids (e.g. "
                    f"torch.arange({full_S})[None]) and, with eager attention or padding, the full-sequence 4D "
                    "attention mask, or set sequence_parallel=False."
                )


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
