"""A tiny model with a few blocks (one with routed experts), data, and a train loop for the parity tests.

The reference is one process over the whole global batch; a data-parallel run gives each dp rank
its slice of the same batch, starting from the same weights (every rank builds the model from the
same seed), and reports the global mean loss (the mean over dp ranks of equal-sized slices).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

VOCAB, DIM, HIDDEN, N_LAYERS = 64, 16, 32, 3
BATCH, SEQ, STEPS, LR = 8, 8, 5, 1e-2
BLOCKS = [f"layers.{i}" for i in range(N_LAYERS)]
EXPERTS = ["layers.1.experts"]


class Experts(nn.Module):
    """Grouped experts, weights [E, in, out]; every token goes to every expert (enough for sharding)."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) * hidden**-0.5)

    def forward(self, x_BSD):
        h_BSEH = F.gelu(torch.einsum("bsd,edh->bseh", x_BSD, self.w1))
        return torch.einsum("bseh,ehd->bsd", h_BSEH, self.w2) / self.w1.shape[0]


class Block(nn.Module):
    def __init__(self, n_experts: int = 0):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.experts = Experts(n_experts, DIM, HIDDEN) if n_experts else None

    def forward(self, x_BSD):
        h_BSD = self.norm(x_BSD)
        y_BSD = self.w2(F.gelu(self.w1(h_BSD)))
        if self.experts is not None:
            y_BSD = y_BSD + self.experts(h_BSD)
        return x_BSD + y_BSD


class TinyModel(nn.Module):
    def __init__(self, n_experts: int = 0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(n_experts if i == 1 else 0) for i in range(N_LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens_BS):
        h = self.tok_embeddings(tokens_BS)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_model(n_experts: int = 0, seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel(n_experts)


def global_batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_fn(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())


def train(model, dp_rank=0, dp_degree=1, dp_group=None, after_backward=None, autocast=None, first_grads=None):
    """STEPS AdamW steps on this rank's slice of each global batch; the global mean loss per step.

    `first_grads`, a dict, receives the first step's full gradients by parameter name (AdamW hides a
    gradient's scale, so a wrong divide factor shows only there).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per = BATCH // dp_degree
    losses = []
    for tokens, labels in global_batches():
        tokens, labels = tokens[dp_rank * per : (dp_rank + 1) * per], labels[dp_rank * per : (dp_rank + 1) * per]
        if autocast is None:
            loss = loss_fn(model(tokens), labels)
        else:
            with autocast:
                loss = loss_fn(model(tokens), labels)
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        if first_grads is not None and not first_grads:
            first_grads.update(_full_grads(model))
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss = loss / dp_degree
        losses.append(loss.item())
    return losses


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name.removeprefix("module.")] = grad.detach().clone()
    return out


def reference(n_experts: int = 0) -> dict:
    """The single-process run: per-step losses, first-step gradients and the final parameters."""
    model = build_model(n_experts)
    grads = {}
    losses = train(model, first_grads=grads)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "params": params}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters by their unwrapped names (a collective for DTensors: call on every rank)."""
    out = {}
    for name, value in model.state_dict().items():
        name = name.removeprefix("module.")  # DDP
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    return out


def local_param_bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def reshard_after_forward_of(model: nn.Module) -> dict[str, bool | int]:
    """What FSDP will do after each unit's forward: False, True, or the group size it keeps."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        post = group.post_forward_mesh_info
        if post is None:
            out[name] = False
        elif post is group.mesh_info:
            out[name] = True
        else:
            out[name] = post.shard_mesh_size
    return out


def assert_parity(got: dict, ref: dict, params: bool = True) -> None:
    """Per-step losses within 1e-5 of the 1-process reference; with `params`, first-step gradients
    (a wrong scale hides behind AdamW) and final parameters too."""
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
    if params:
        assert got["grads"].keys() == ref["grads"].keys()
        for name, value in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], value, atol=1e-6, rtol=1e-4, msg=name)
        assert got["params"].keys() == ref["params"].keys()
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-4, msg=name)


def assert_sharded_bytes(got_bytes: int, ref: dict, shards: int) -> None:
    """Local parameter bytes are 1/shards of the model, within one row of each matrix."""
    total = sum(v.numel() * v.element_size() for v in ref["params"].values())
    one_row_each = sum(v[0].numel() * v.element_size() for v in ref["params"].values() if v.ndim > 1)
    assert abs(got_bytes - total / shards) <= one_row_each
