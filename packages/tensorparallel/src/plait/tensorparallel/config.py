"""What tensor parallel is asked to do, and the checks that run before any collective.

Every error names the configuration key to change and how, and is raised identically on every
rank (the checks read only the config and the model's plain-data metadata), so a bad layout stops
the job before a process group could hang on it.
"""

from dataclasses import dataclass

import torch

from plait.mesh import ParallelConfigError


class TensorParallelConfigError(ParallelConfigError):
    """A tensor-parallel setting that cannot work; the message names the key and the fix.

    A ParallelConfigError, so a composer catches every package's layout errors as one type."""


@dataclass
class TensorParallelConfig:
    """Options of tensor parallel; the degree itself is the size of the tp mesh.

    sequence_parallel: between blocks, activations (and norms) are sharded on the sequence dim
        (Megatron-SP): all-gather into a block, reduce-scatter out of it, instead of all-reduce.
        Needs the sequence length divisible by tp.
    loss_parallel: the output projection's logits stay sharded on the vocabulary dim (a DTensor)
        and cross-entropy runs on the shards inside `loss_parallel_context(True)`; the full
        `[B, S, V]` logits are never gathered. Only matters when the plan has `output_colwise`.
    async_tp: overlap the sequence-parallel all-gather / reduce-scatter with the matmuls next to
        them (torch's micro-pipeline TP over symmetric memory). CUDA, sequence parallel and
        `torch.compile` of the blocks only.
    external_modules: fnmatch patterns (`*` = one path component) of modules another package
        parallelises, e.g. the routed experts under expert parallel; their plan entries are skipped
        and their parameters may stay plain tensors.
    """

    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool = False
    external_modules: tuple[str, ...] = ()


def validate_tensor_parallel(
    parallel_info: dict, tp: int, seq_len: int | None, config: TensorParallelConfig
) -> None:
    """Check, before any collective, that the model and sequence length fit a tp degree.

    `parallel_info` is the model's `parallel_info()` (its `tp_divisible` sizes are read), `seq_len`
    the training sequence length (None skips that check). Raises TensorParallelConfigError.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise TensorParallelConfigError(f"parallelism.tp = {tp!r}: the tensor-parallel degree must be an integer >= 1.")
    if config.async_tp:
        check_async_tp(tp, config)
    if tp == 1:
        return
    for key, size in parallel_info.get("tp_divisible", {}).items():
        if size % tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise TensorParallelConfigError(
                f"parallelism.tp = {tp} does not divide the model's {key} = {size}: tensor parallel splits "
                f"{key} evenly across ranks. Use a tp that divides it ({', '.join(map(str, divisors))}) "
                f"or change the model's {key}."
            )
    if config.sequence_parallel and seq_len is not None and seq_len % tp:
        raise TensorParallelConfigError(
            f"training.seq_len = {seq_len} is not divisible by parallelism.tp = {tp}: sequence parallel "
            f"shards activations on the sequence dim. Use a seq_len that is a multiple of {tp}, or set "
            "parallelism.sequence_parallel = false."
        )


def check_async_tp(tp: int, config: TensorParallelConfig) -> None:
    if not torch.cuda.is_available():
        raise TensorParallelConfigError(
            "parallelism.async_tp = true needs CUDA (symmetric memory and torch.compile's micro-pipeline "
            "TP pass are GPU-only); this process has no CUDA device. Set parallelism.async_tp = false."
        )
    if tp > 1 and not config.sequence_parallel:
        raise TensorParallelConfigError(
            "parallelism.async_tp = true overlaps sequence parallel's all-gather / reduce-scatter with "
            "matmuls, so it needs parallelism.sequence_parallel = true."
        )
