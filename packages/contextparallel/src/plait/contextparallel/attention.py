"""The module that replaces a model's `sdpa` submodules, and `apply_context_parallel`."""

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import kernels
from .allgather import AllGatherAttention
from .config import ContextParallelConfig
from .documents import document_segments
from .layout import SequenceLayout
from .ring import RingAttention
from .ulysses import UlyssesAttention

_FUNCTIONS = {"allgather": AllGatherAttention, "ring": RingAttention, "ulysses": UlyssesAttention}


class ContextParallelAttention(nn.Module):
    """Causal or document attention over a sequence sharded across the cp mesh, in `layout`'s order.

    Takes and returns what the model's sdpa module does: q [B, H, S/cp, Dqk], k [B, G, S/cp, Dqk],
    v [B, G, S/cp, Dv] -> [B, H, S/cp, Dv], where S/cp are this rank's tokens, and optionally
    document_positions_BS [B, S]: the FULL rows' offsets inside their documents (the same on every
    cp rank; None: causal). Its segments are read on the host once per tensor and cached on it.
    A model may pass the folded rows' document offsets after them (plait's models do); they are
    accepted and not needed.
    """

    def __init__(self, mesh: DeviceMesh, method: str, layout: SequenceLayout, scale: float | None = None):
        super().__init__()
        self.mesh, self.method, self.layout, self.scale = mesh, method, layout, scale
        self._function = _FUNCTIONS[method]

    # The collectives inside cannot be traced: a compiled block calls this eagerly.
    @torch.compiler.disable
    def forward(
        self,
        q_BHLD: torch.Tensor,
        k_BGLD: torch.Tensor,
        v_BGLD: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # document_offsets (the folded rows' document starts that a model's own attention takes)
        # are not needed here: the plans come from the rows' boundaries, read on the host.
        scale = self.scale if self.scale is not None else q_BHLD.shape[-1] ** -0.5
        segments = None
        if document_positions_BS is not None:
            segments = document_segments(document_positions_BS)
            B, L = q_BHLD.shape[0], q_BHLD.shape[2]
            if (segments.batch, segments.seq_len) != (B, L * self.layout.cp):
                raise ValueError(
                    f"document_positions [{segments.batch}, {segments.seq_len}] must be the full rows "
                    f"[{B}, {L * self.layout.cp}] of these q/k/v shards ({L} tokens per rank x cp {self.layout.cp})"
                )
            if segments.single_document_rows:  # no boundary inside any row: exactly the causal plan
                segments = None
        return self._function.apply(q_BHLD, k_BGLD, v_BGLD, self.mesh.get_group(), self.layout, scale, segments)

    def extra_repr(self) -> str:
        layout = self.layout
        return f"method={self.method}, cp={layout.cp}, load_balance={layout.load_balance}, rounds={layout.rounds}"


def apply_context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, attention_modules: Sequence[str], config: ContextParallelConfig
) -> SequenceLayout:
    """Replace each attention module (`parallel_info()["attention_modules"]`) with context-parallel
    attention over `cp_mesh`, keeping its softmax `scale`. Returns the sequence layout that the
    batch must be sharded in (`shard_sequence`, `SequenceLayout.local_indices` for positions)."""
    layout = SequenceLayout(cp_mesh.size(), config.load_balance, config.load_balance_rounds)
    kernels.CPU_HALF_IN_FP32 = config.cpu_half_in_fp32  # one process, one run: its models' rule
    for path in attention_modules:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        original = getattr(parent, name)
        setattr(parent, name, ContextParallelAttention(cp_mesh, config.method, layout, getattr(original, "scale", None)))
    return layout
