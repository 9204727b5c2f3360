"""plait.contextparallel on the device under test: every CUDA-only branch against math attention.

The CUDA-only branches of the package are all in `kernels._kernel` (which kernel a block runs on):
  - fp16/bf16, head dim a multiple of 8 and <= 256 -> aten._scaled_dot_product_flash_attention and
    its backward (FlashAttention-2), with MLA's narrower values zero-padded;
  - anything else on CUDA (fp32, or an odd head dim) -> the explicit fp32 `math_forward/backward`.
Everything around them (block plans, lse merge, packing, the chunk reorders of the all-gather and
all-to-alls, index tensors cached per device) runs on the device too. The collectives are NCCL on
GPU: one GPU cannot hold two ranks of one communicator, so the cp ranks are simulated in one process
(each rank's q against the K/V blocks it would receive, the collectives replaced by the tensor
operations they perform); a 1-rank NCCL group runs the real autograd functions.

Reference: F.scaled_dot_product_attention (math backend) over the full sequence in fp32, on the same
(dtype-rounded) inputs, for the output and the q, k, v gradients. Tolerances: fp32 1e-4; bf16 2e-2
of the reference's largest magnitude (bf16 keeps 8 mantissa bits, ~4e-3 per rounding; inputs,
outputs and gradients are each rounded once or twice, accumulation is fp32 in every kernel).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from plait.contextparallel import SequenceLayout, kernels, plan_blocks, shard_sequence, unshard_sequence
from plait.contextparallel.allgather import rank_major, unpack_gathered
from plait.contextparallel.blockwise import blocks_backward, blocks_forward
from plait.contextparallel.comm import pack, unpack
from plait.contextparallel.kernels import MergedAttention, accum_dtype, attention_backward, attention_forward
from plait.contextparallel.ring import _plans
from plait.contextparallel.ulysses import heads_by_rank, heads_from_ranks, kv_repeats, seq_by_rank, seq_from_ranks

aten = torch.ops.aten
SHAPES = {  # (H, G, Dqk, Dv)
    "gqa": (8, 2, 64, 64),  # flash on CUDA bf16; Ulysses at cp 4 repeats the kv heads
    "mla": (4, 4, 192, 128),  # DeepSeek-V3 head dims: values zero-padded to 192 for flash
    "odd": (4, 2, 20, 20),  # head dim not a multiple of 8: the math kernel on CUDA, in bf16 too
}
FLASH_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "cpu_flash",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "cpu_flash",
    aten._scaled_dot_product_flash_attention.default: "cuda_flash",
    aten._scaled_dot_product_flash_attention_backward.default: "cuda_flash",
}


class KernelCalls(TorchDispatchMode):
    """Which flash kernels ran, and every precondition their inputs broke (kernels.flash_input_problems)."""

    def __init__(self):
        super().__init__()
        self.kernels, self.problems = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in FLASH_OPS:
            self.kernels.add(FLASH_OPS[func])
            if "backward" in func.name():
                dout, q, k, v, out, lse = args[:6]
                self.problems += kernels.flash_input_problems(q, k, v, out=out, dout=dout, lse=lse)
            else:
                self.problems += kernels.flash_input_problems(*args[:3])
        return func(*args, **(kwargs or {}))


def _inputs(device, dtype, shape, cp, chunk, seed=0):
    H, G, dqk, dv = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    S = 2 * cp * chunk
    q, k, v, dout = (torch.randn(2, n, S, d, generator=g) for n, d in ((H, dqk), (G, dqk), (G, dv), (H, dv)))
    # As the models pass them: transposed views of [B, S, heads, D] projections.
    return [t.to(device, dtype).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)] + [dout.to(device, dtype)]


def _reference(q, k, v, dout, scale):
    """fp32 math attention over the whole sequence, with the q, k, v gradients."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q32, k32.repeat_interleave(rep, 1), v32.repeat_interleave(rep, 1), is_causal=True, scale=scale
        )
    out.backward(dout.float())
    return out.detach(), q32.grad, k32.grad, v32.grad


# ---- each method's ranks, simulated on one device -----------------------------------------------------


def _allgather(q, k, v, dout, layout, scale):
    cp, chunk, d = layout.cp, q.shape[2] // layout.n_chunks, k.shape[-1]
    qs, ks, vs, douts = ([shard_sequence(t, 2, r, layout) for r in range(cp)] for t in (q, k, v, dout))
    # The all-gather: every rank receives every rank's packed [K | V].
    gathered = torch.stack([pack(ks[r], vs[r]) for r in range(cp)])
    k_full, v_full = unpack_gathered(gathered, ks[0].shape, vs[0].shape, layout)
    outs, dqs = [], []
    B, G, S, _ = k_full.shape
    dkv_sum = torch.zeros(B, G, S, d + v.shape[-1], dtype=accum_dtype(q.dtype), device=q.device)
    for r in range(cp):
        blocks = plan_blocks(layout.chunks(r), range(layout.n_chunks))
        acc = MergedAttention(qs[r], v.shape[-1])
        blocks_forward(acc, qs[r], k_full, v_full, blocks, chunk, scale)
        out = acc.out.to(q.dtype)
        dq = torch.zeros(qs[r].shape, dtype=accum_dtype(q.dtype), device=q.device)
        dkv = torch.zeros_like(dkv_sum)
        blocks_backward(dq, dkv[..., :d], dkv[..., d:], douts[r], qs[r], k_full, v_full, out, acc.lse, blocks, chunk, scale)
        dkv_sum += dkv  # the reduce-scatter's sum
        outs.append(out)
        dqs.append(dq)
    dkv_R = rank_major(dkv_sum, layout)  # rank r receives dkv_R[r]
    return outs, dqs, [dkv_R[r][..., :d] for r in range(cp)], [dkv_R[r][..., d:] for r in range(cp)]


def _ring(q, k, v, dout, layout, scale):
    cp, chunk, d = layout.cp, q.shape[2] // layout.n_chunks, k.shape[-1]
    qs, ks, vs, douts = ([shard_sequence(t, 2, r, layout) for r in range(cp)] for t in (q, k, v, dout))
    shapes = (ks[0].shape, vs[0].shape)
    outs, dqs = [], []
    dkvs = [torch.zeros((*ks[0].shape[:-1], d + v.shape[-1]), dtype=accum_dtype(q.dtype), device=q.device)
            for _ in range(cp)]  # fmt: skip
    for r in range(cp):
        plans = _plans(layout, r)  # step s holds the K/V of rank r - s
        acc = MergedAttention(qs[r], v.shape[-1])
        for s, blocks in enumerate(plans):
            src = (r - s) % cp
            blocks_forward(acc, qs[r], *unpack(pack(ks[src], vs[src]), shapes), blocks, chunk, scale)
        out = acc.out.to(q.dtype)
        dq = torch.zeros(qs[r].shape, dtype=accum_dtype(q.dtype), device=q.device)
        for s, blocks in enumerate(plans):
            src = (r - s) % cp
            dkv = torch.zeros_like(dkvs[src])
            kv = unpack(pack(ks[src], vs[src]), shapes)
            blocks_backward(dq, dkv[..., :d], dkv[..., d:], douts[r], qs[r], *kv, out, acc.lse, blocks, chunk, scale)
            dkvs[src] += dkv  # the accumulator travelling with block src, home at the end
        outs.append(out)
        dqs.append(dq)
    return outs, dqs, [x[..., :d] for x in dkvs], [x[..., d:] for x in dkvs]


def _all_to_all(sends):
    """Rank j receives slice j of every rank's send, stacked by source rank."""
    return [torch.stack([send[j] for send in sends]) for j in range(len(sends))]


def _ulysses(q, k, v, dout, layout, scale):
    cp = layout.cp
    repeats = kv_repeats(k.shape[1], cp)
    k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)

    def to_heads(x):
        return [heads_from_ranks(t, layout) for t in _all_to_all([heads_by_rank(shard_sequence(x, 2, r, layout), cp)
                                                                   for r in range(cp)])]  # fmt: skip

    def to_seq(per_head):
        return [seq_from_ranks(t) for t in _all_to_all([seq_by_rank(y, layout) for y in per_head])]

    q_h, k_h, v_h, dout_h = (to_heads(t) for t in (q, k, v, dout))
    fwd = [attention_forward(q_h[h], k_h[h], v_h[h], True, scale) for h in range(cp)]
    grads = [attention_backward(dout_h[h], q_h[h], k_h[h], v_h[h], *fwd[h], True, scale) for h in range(cp)]
    outs = to_seq([o for o, _ in fwd])
    dqs, dks, dvs = (to_seq([g[i] for g in grads]) for i in range(3))

    def unrepeat(x):
        B, G, L, D = x.shape
        return x.view(B, G // repeats, repeats, L, D).sum(2)

    return outs, dqs, [unrepeat(x) for x in dks], [unrepeat(x) for x in dvs]


SIMULATE = {"allgather": _allgather, "ring": _ring, "ulysses": _ulysses}


def _check(got, want, dtype, what):
    scale = want.abs().max().item()
    tol = 1e-4 * max(scale, 1.0) if dtype == torch.float32 else 2e-2 * scale
    err = (got.float() - want).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (reference max {scale:.3g})"


def _expected_kernel(device, dtype, shape):
    if device.type == "cpu":
        return "cpu_flash"
    dqk = SHAPES[shape][2]
    return "cuda_flash" if dtype in (torch.float16, torch.bfloat16) and dqk % 8 == 0 and dqk <= 256 else "math"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cp, load_balance", [(2, True), (4, True), (4, False)])
@pytest.mark.parametrize("method", SIMULATE)
def test_cp_ranks_match_math_attention(device, method, cp, load_balance, shape, dtype):
    """CUDA branch: contextparallel/kernels.py:_kernel (attention_forward / attention_backward) --
    each method's per-rank blocks (all-gather, ring, Ulysses head split), merged by log-sum-exp,
    give math attention's output and q/k/v gradients on the full sequence; every kernel call's
    inputs meet the CUDA flash preconditions; the expected kernel ran."""
    chunk = 96 if device.type == "cuda" else 8  # 96: not a multiple of the flash tiles (64 / 128)
    layout = SequenceLayout(cp, load_balance)
    q, k, v, dout = _inputs(device, dtype, shape, cp, chunk, seed=cp)
    scale = q.shape[-1] ** -0.5
    calls = KernelCalls()
    with calls:
        outs, dqs, dks, dvs = SIMULATE[method](q, k, v, dout, layout, scale)
    assert calls.problems == [], calls.problems[:5]
    kernel = _expected_kernel(device, dtype, shape)
    assert calls.kernels == ({kernel} if kernel != "math" else set()), (calls.kernels, kernel)
    ref = _reference(q, k, v, dout, scale)
    got = [unshard_sequence(x, 2, layout) for x in (outs, dqs, dks, dvs)]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        _check(g, r, dtype, f"{method} cp={cp} lb={load_balance} {shape} {dtype} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_choice(device, dtype):
    """CUDA branch: contextparallel/kernels.py:_kernel -- flash for fp16/bf16 with head dim a multiple
    of 8 up to 256 (what FlashAttention-2's backward accepts), math otherwise; the CPU always flash."""
    for dqk in (8, 20, 64, 192, 256, 264):
        q = torch.zeros(1, 1, 4, dqk, device=device, dtype=dtype)
        want = _expected_kernel(device, dtype, "gqa") if dqk % 8 == 0 and dqk <= 256 else (
            "cpu_flash" if device.type == "cpu" else "math")  # fmt: skip
        assert kernels._kernel(q) == want, (dqk, dtype)


def test_index_tensors_built_once_per_device(device):
    """CUDA branch: contextparallel/layout.py:_order_indices -- the chunk-order indices are built on
    the device (arange, no host-to-device copy), once per layout and device, equal to the Python orders."""
    layout = SequenceLayout(4, True)
    first = layout.natural_order_index(device)
    assert first.device.type == device.type
    assert layout.natural_order_index(device) is first
    assert SequenceLayout(4, True).rank_order_index(device) is layout.rank_order_index(device)
    assert first.tolist() == layout.natural_order()
    assert layout.rank_order_index(device).tolist() == layout.rank_order()
    assert SequenceLayout(3, False).rank_order_index(device).tolist() == SequenceLayout(3, False).rank_order()


@pytest.mark.cuda_only
@pytest.mark.parametrize("method", SIMULATE)
def test_simulated_step_does_not_sync(device, method):
    """CUDA branch: contextparallel (every method, flash kernels) -- a whole forward + backward, the
    first (which builds the index tensors) and the next, runs under set_sync_debug_mode("error")."""
    from plait.contextparallel import layout as layout_module

    layout = SequenceLayout(2, True)
    q, k, v, dout = _inputs(device, torch.bfloat16, "gqa", 2, 64)
    torch.cuda.synchronize()
    layout_module._order_indices.cache_clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            SIMULATE[method](q, k, v, dout, layout, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("method", SIMULATE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_rank_group_runs_the_autograd_functions(device, one_rank_mesh, method, dtype):
    """CUDA branch: contextparallel/comm.py (NCCL all_gather_single, reduce_scatter_single,
    all_to_all_single; the ring sends nothing at cp 1) -- the real autograd functions on a 1-rank
    group (cp 1: two chunks) match math attention, forward and backward."""
    from plait.contextparallel.attention import _FUNCTIONS

    layout = SequenceLayout(1, True)
    q, k, v, dout = _inputs(device, dtype, "mla", 1, 64 if device.type == "cuda" else 8)
    local = [t.detach().requires_grad_() for t in (q, k, v)]
    out = _FUNCTIONS[method].apply(*local, one_rank_mesh.get_group(), layout, 0.1)
    out.backward(dout)
    ref = _reference(q, k, v, dout, 0.1)
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), ref):
        assert g.dtype == dtype
        _check(g.detach(), r, dtype, f"{method} {dtype} {name}")


def _nccl_rank(rank, world_size, store_path, out_dir, backend):
    """One rank of the multi-GPU test: every method on the real collectives vs math attention."""
    from plait.contextparallel.attention import _FUNCTIONS

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
                            **kwargs)  # fmt: skip
    try:
        errors = {}
        chunk = 96 if device.type == "cuda" else 8
        for method in SIMULATE:
            for load_balance, shape, dtype in ((True, "gqa", torch.bfloat16), (False, "gqa", torch.float32),
                                               (True, "mla", torch.bfloat16)):  # fmt: skip
                layout = SequenceLayout(world_size, load_balance)
                q, k, v, dout = _inputs(device, dtype, shape, world_size, chunk, seed=1)
                local = [shard_sequence(t, 2, rank, layout).detach().requires_grad_() for t in (q, k, v)]
                out = _FUNCTIONS[method].apply(*local, dist.group.WORLD, layout, 0.1)
                out.backward(shard_sequence(dout, 2, rank, layout))
                ref = _reference(q, k, v, dout, 0.1)
                for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), ref):
                    _check(g.detach(), shard_sequence(r, 2, rank, layout), dtype, f"rank {rank} {method} {shape} {dtype} {name}")
                errors[(method, load_balance, shape, str(dtype))] = "ok"
        if device.type == "cuda":
            torch.cuda.synchronize()
        torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, backend: str) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_rank, args=(world_size, os.path.join(tmp, "store"), tmp, backend), nprocs=world_size)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]


def test_nccl_ranks_match_math_attention(device, n_gpus):
    """CUDA branch: contextparallel/comm.py on NCCL (all_gather_single, reduce_scatter_single,
    all_to_all_single, batch_isend_irecv ring, tags ignored) with the flash kernels -- every method
    on min(GPUs, 4) ranks, each rank's output and q/k/v gradients against math attention.
    (The CPU dry run runs the same ranks on gloo.)"""
    if device.type == "cuda" and n_gpus < 2:
        pytest.skip(f"needs >= 2 GPUs for an NCCL group of 2 ranks ({n_gpus} here)")
    world_size = 4 if n_gpus >= 4 else 2
    results = run_ranks(world_size, "nccl" if device.type == "cuda" else "gloo")
    assert all(len(r) == 9 for r in results), results
