"""The step sentinel: each host-sync kind and precondition caught at its source line; clean code
(matmul, SDPA forward/backward, DTensor, an FSDP2 step on 2 gloo ranks) records nothing."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from plait.mesh.declared_sync import declared_sync
from plait.testing import run_on_ranks
from plait.testing.sentinel import StepSentinel


def _line(marker: str) -> int:
    """The line of this file that ends with `# <- marker`."""
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def _where(record) -> tuple[str, int]:
    path, line = record.where.rsplit(":", 1)
    return path.rsplit("/", 1)[-1], int(line)


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.sum().tolist()  # <- backward_tolist
        return grad * 2


def _cases():
    x = torch.randn(8, 4)
    mask = x > 0
    device = torch.device("cpu")  # the compute device of a CPU run
    return {
        "item": ("item", lambda: x.sum().item()),  # <- item
        "bool": ("item", lambda: bool(x.sum() > 0)),  # <- bool
        "int": ("item", lambda: int(x.sum())),  # <- int
        "float": ("item", lambda: float(x.sum())),  # <- float
        "local_scalar_dense": ("item", lambda: torch.ops.aten._local_scalar_dense(x.sum())),  # <- local_scalar_dense
        "tolist": ("tolist", lambda: x.tolist()),  # <- tolist
        "nonzero": ("nonzero", lambda: torch.nonzero(mask)),  # <- nonzero
        "argwhere": ("nonzero", lambda: mask.argwhere()),  # <- argwhere
        "where1": ("nonzero", lambda: torch.where(mask)),  # <- where1
        "masked_select": ("nonzero", lambda: x.masked_select(mask)),  # <- masked_select
        "bool_index": ("bool_mask_index", lambda: x[mask]),  # <- bool_index
        "bool_index_put": ("bool_mask_index", lambda: x.clone().index_put_((mask,), x[0, 0], accumulate=True)),  # <- bool_index_put
        "unique": ("data_dependent_shape", lambda: torch.unique(mask)),  # <- unique
        "repeat_interleave": ("data_dependent_shape", lambda: torch.repeat_interleave(mask.long().sum(1))),  # <- repeat_interleave
        "bincount": ("data_dependent_shape", lambda: mask.long().sum(1).bincount()),  # <- bincount
        "equal": ("item", lambda: x.equal(x)),  # <- equal
        "allclose": ("item", lambda: torch.allclose(x, x)),  # <- allclose
        "tensor": ("python_data", lambda: torch.tensor([1, 2, 3], device=device)),  # <- tensor
        "as_tensor": ("python_data", lambda: torch.as_tensor([1, 2], device=device)),  # <- as_tensor
        "new_tensor": ("python_data", lambda: x.new_tensor([1.0])),  # <- new_tensor
        "cpu": ("to_cpu", lambda: x.cpu()),  # <- cpu
        "to_cpu": ("to_cpu", lambda: x.to("cpu")),  # <- to_cpu
        "numpy": ("to_cpu", lambda: x.numpy()),  # <- numpy
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_cases()))
def test_each_host_sync_is_recorded_once_at_its_line(name):
    kind, fn = _cases()[name]
    with StepSentinel(device="cpu") as s:
        try:
            fn()
        except RuntimeError as e:  # .numpy() without numpy installed: recorded before torch refuses
            if "Numpy is not available" not in str(e):
                raise
    assert [(r.kind, _where(r)) for r in s.host_syncs] == [(kind, ("test_sentinel.py", _line(name)))]
    assert s.violations == [] and s.step_counts() == [(1, 0)]


def test_syncs_inside_backward_and_checkpoint_recompute_are_seen():
    lin = torch.nn.Linear(4, 4)

    def block(x):
        y = lin(x)
        return y[y > 0].sum()  # <- checkpointed

    x = torch.randn(3, 4, requires_grad=True)
    with StepSentinel(device="cpu") as s:
        _SyncInBackward.apply(x).sum().backward()
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).backward()  # <- checkpoint_backward
    got = sorted((r.kind, _where(r)[1]) for r in s.host_syncs)
    # The mask index runs twice (forward and recompute); its backward (index_put with the mask) once.
    assert got == sorted(
        [
            ("tolist", _line("backward_tolist")),
            ("bool_mask_index", _line("checkpointed")),
            ("bool_mask_index", _line("checkpointed")),
            ("bool_mask_index", _line("checkpoint_backward")),
        ]
    )


def test_declared_sync_still_counts_and_says_so():
    x = torch.randn(4)
    with StepSentinel(device="cpu") as s:
        with declared_sync("split sizes"):
            x.tolist()
        x.tolist()
    assert len(s.host_syncs) == 2
    assert [r.declared for r in s.host_syncs] == [True, False]
    assert "split sizes" in s.host_syncs[0].detail


def test_host_data_that_stays_on_the_host_is_not_a_sync():
    x = torch.randn(4)
    with StepSentinel(device="cpu") as s:
        step = torch.tensor(0.0, device="cpu")  # host data on purpose (the optimizer's step counter)
        step += 1
        step.item()
        torch.tensor([1, 2]).tolist()  # no device: stays on the host
        x.to(torch.device("cpu"))  # the input copy to the compute device (cpu here)
        x.to("cpu", non_blocking=True)
        x.to(torch.float64)
        y = x.clone()
        y[y > 0] = 0  # one mask, one value: index_put_ runs it as masked_fill_ (no nonzero)
        y[y > 0] = torch.tensor(1.0)  # a host value too
        z = torch.randn(4, 3)
        z[z[:, 0] > 0, :] = 0.0  # basic indices around the mask: still masked_fill_
    assert s.host_syncs == []
    with StepSentinel(device="cpu") as s:
        y[y > 0] = y.sum()  # <- device_value
    # A value on the compute device is not a masked_fill on CUDA: index_put_ runs nonzero.
    assert [(r.kind, _where(r)[1]) for r in s.host_syncs] == [("bool_mask_index", _line("device_value"))]


def test_step_counts_and_report_per_entry():
    x = torch.randn(4)
    s = StepSentinel(device="cpu")
    for n in (0, 2, 1):
        with s:
            for _ in range(n):
                x.sum().item()  # <- report_item
    assert s.step_counts() == [(0, 0), (2, 0), (1, 0)]
    text = s.report()
    assert "3 host syncs" in text and f"test_sentinel.py:{_line('report_item')}" in text
    assert "    3 x item" in text
    # Outside the sentinel nothing is recorded and torch is unpatched.
    x.sum().item()
    assert len(s.host_syncs) == 3 and torch.Tensor.item.__name__ == "item" and not hasattr(torch.tensor, "__wrapped__")


def test_clean_matmul_and_sdpa_forward_backward_record_nothing():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    kv = torch.randn(2, 2, 16, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with StepSentinel(device="cpu") as s:
        out = F.scaled_dot_product_attention(q @ w, kv, kv, is_causal=True, enable_gqa=True)
        out.sum().backward()
    assert s.host_syncs == [] and s.violations == [], s.report()


def _flash_backward(lse):
    q = torch.randn(1, 2, 8, 4)
    out, lse_full = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)[:2]
    lse = lse(lse_full)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        torch.ones_like(out), q, q, q, out, lse, 0.0, True
    )


def test_flash_backward_with_a_strided_logsumexp_is_a_violation():
    with StepSentinel(device="cpu") as clean:
        _flash_backward(lambda lse: lse)  # the forward's own layout
        _flash_backward(lambda lse: lse.contiguous())
    assert clean.violations == [], clean.report()
    with StepSentinel(device="cpu") as s:
        # A sequence slice of a larger lse (what blockwise attention does with lse[:, :, rows]).
        _flash_backward(lambda lse: torch.cat([lse, lse], dim=2)[:, :, ::2])
    assert [(r.kind, "logsumexp" in r.detail) for r in s.violations] == [("sdpa", True)]
    assert s.host_syncs == []


def test_sdpa_forward_with_a_strided_head_dim_is_a_violation():
    q = torch.randn(1, 2, 8, 4)
    k = torch.randn(1, 2, 4, 8).transpose(-1, -2)  # head dim stride 8
    with StepSentinel(device="cpu") as s:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, q, 0.0, True)  # <- strided_k
    assert [(r.kind, _where(r)[1]) for r in s.violations] == [("sdpa", _line("strided_k"))]
    assert "key stride(-1)" in s.violations[0].detail


def test_grouped_mm_preconditions():
    a = torch.randn(16, 8)
    b = torch.randn(2, 8, 8)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with StepSentinel(device="cpu") as clean:
        torch._grouped_mm(a, b, offs=offs)
        torch._grouped_mm(a, b.transpose(-1, -2), offs=offs)  # column-major mat_b: allowed
    assert clean.violations == [], clean.report()
    with StepSentinel(device="cpu") as s:
        try:  # the CPU kernel may refuse float offsets itself; the record comes first
            torch._grouped_mm(a, b, offs=offs.float())  # <- float_offs
        except RuntimeError:
            pass
    assert [(r.kind, _where(r)[1]) for r in s.violations] == [("grouped_mm", _line("float_offs"))]
    assert "offs dtype torch.float32" in s.violations[0].detail
    # Weight-gradient form (2-D x 2-D, groups along the contraction dim): with a row-major [M, K]
    # mat_a a group of 3 columns starts 12 bytes in; as [K, M] transposed (what autograd passes)
    # every group start is a whole row of 16 * 4 bytes.
    grad_BN, x_KM = torch.randn(16, 8), torch.randn(16, 16)
    odd = torch.tensor([3, 16], dtype=torch.int32)
    with StepSentinel(device="cpu") as s:
        torch._grouped_mm(x_KM.T, grad_BN, offs=odd)
    assert s.violations == [], s.report()
    with StepSentinel(device="cpu") as s:
        torch._grouped_mm(x_KM.T.contiguous(), grad_BN, offs=odd)  # <- unaligned_group
    assert [(r.kind, _where(r)[1]) for r in s.violations] == [("grouped_mm", _line("unaligned_group"))]
    assert "group 0 has 3 rows: mat_a" in s.violations[0].detail
    a_odd = torch.randn(16 * 9 + 1)[1:].view(16, 9)[:, :8]  # data pointer 4 bytes off, row stride 9
    with StepSentinel(device="cpu") as s, pytest.raises(RuntimeError):  # torch's CPU check agrees
        torch._grouped_mm(a_odd, b, offs=offs)
    details = " | ".join(r.detail for r in s.violations)
    assert "not 16-byte aligned" in details and "stride 9 not a multiple of 16 bytes" in details


def _distributed_checks(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    dt = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    s = StepSentinel(device="cpu")
    for _ in range(2):
        with s:
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            (dt @ dt.T).full_tensor()  # DTensor matmul + its collectives
            dist.all_reduce(torch.ones(4, 4))
    clean = (s.step_counts(), s.report())
    with s:
        dist.all_reduce(torch.ones(4, 6).T)  # <- noncontiguous_allreduce
        (dt.sum() > 0).item()  # <- dtensor_item
    return clean, [(r.kind, _where(r)[1]) for r in s.host_syncs], [(r.kind, _where(r)[1]) for r in s.violations]


def test_dtensor_fsdp2_and_collectives_on_two_ranks():
    for (counts, report), syncs, violations in run_on_ranks(_distributed_checks, 2, timeout=120):
        assert counts == [(0, 0), (0, 0)], report
        assert syncs == [("item", _line("dtensor_item"))]
        assert violations == [("collective", _line("noncontiguous_allreduce"))]
