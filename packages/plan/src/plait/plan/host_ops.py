"""Host work of a step, counted: the ops it dispatches. Each one is at least one kernel launch on a GPU.

    with HostOpCounter() as ops:
        trainer.train_step(micro_batches)
    ops.ops(), ops.kernel_ops(), ops.by_op().most_common(10)

A TorchDispatchMode sees each op once, as it reaches the Python dispatch layer below autograd:
aten ops (a CompositeImplicitAutograd op as what it decomposes into: `linear` as `t` + `addmm`),
collectives (`c10d::`, `_c10d_functional::`) and custom ops (`plait::`, `fsdp::`) as one op each,
not what they run inside. Tensor subclasses (DTensor) desugar first, so the ops counted are the
local ones that run on this rank's tensors; the placeholder ops of DTensor's sharding propagation
(shape inference on fake tensors, no kernel) are not counted. FakeTensors are counted like real
ones: a step traced without data (plait-plan) counts what the real step dispatches (the metadata
queries a FakeTensor answers in Python, `prim::device` and symbolic sizes, are no ops: not counted).

`ops` counts every op; `kernel_ops` leaves out NO_KERNEL, the ops that launch no kernel on a GPU.
Both are reported, so nothing is hidden by the list.

Self-contained (imports only torch): the planner uses it, and the benchmark loads this file by path
in torchtitan's environment to count torchtitan's step the same way.
"""

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel on a GPU, by "namespace::name" of the op (every overload).
# - Views: a new tensor header over the same storage (sizes, strides, offset), computed on the
#   host. `reshape` and `flatten` are not ops of their own here: they reach a dispatch mode as
#   `view` / `_unsafe_view` when they can be a view, and as a copy (`clone`, `_reshape_copy`:
#   counted) when they cannot. `contiguous` likewise reaches it as `clone` only when it copies.
# - Allocations: `empty`-like ops take memory from the caching allocator without touching it
#   (`zeros`, `ones`, `full`, `*_like` with a value do launch a fill kernel: counted).
# - `lift_fresh`: makes a freshly built tensor (a `torch.tensor(...)` constant) the op's input, no copy.
# - The profiler's `record_function` ranges: host-side annotations (torch.optim's step has one).
# - Functional collectives' bookkeeping: `wait_tensor` makes the compute stream wait for the
#   collective's (an event, no kernel), `_wrap_tensor_autograd` hands its pending result to autograd.
NO_KERNEL = frozenset(
    [f"profiler::{name}" for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")]
    + ["_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"]
) | frozenset(
    f"aten::{name}"
    for name in (
        # views
        "view", "_unsafe_view", "_reshape_alias", "view_as_real", "view_as_complex", "t", "transpose",
        "permute", "expand", "slice", "select", "narrow", "as_strided", "unsqueeze", "squeeze", "split",
        "split_with_sizes", "unbind", "chunk", "unflatten", "unfold", "diagonal", "detach", "alias",
        "_conj", "_neg_view", "lift_fresh",
        # allocations
        "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    )
)  # fmt: skip


# Not ops of the step at all: metadata queries that reach a dispatch mode only for tensors that answer
# them in Python (a FakeTensor's `.device`, symbolic sizes); a real tensor answers them in C++.
_QUERIES = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
                      "is_strides_like_format", "is_non_overlapping_and_dense"})


def _is_query(func) -> bool:
    return func.namespace == "prim" or (func.namespace == "aten" and func._overloadpacket.__name__ in _QUERIES)


def _is_subclass(t) -> bool:
    """A tensor subclass that desugars into ops on plain tensors (DTensor, functional collectives'
    AsyncCollectiveTensor); FakeTensor is the data-less plain tensor of a traced step: counted."""
    if t is torch.Tensor or t.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return False
    return t.__name__ not in ("FakeTensor", "FunctionalTensor")


class Propagating:
    """Entered by DTensor around its sharding propagation (ShardingPropagator._fake_mode_lock, the
    hook torch keeps for a lock): ops on placeholder tensors run inside, which no GPU sees and
    which are not memory (the planner's memory tracker skips them too). `depth` > 0 inside."""

    def __init__(self, inner):
        self.inner, self.depth = inner, 0

    def __enter__(self):
        self.inner.__enter__()
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        return self.inner.__exit__(*exc)


def _sharding_propagator():
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # torch built without distributed
        return None
    return ShardingPropagator


class HostOpCounter(TorchDispatchMode):
    """`with HostOpCounter() as c:` -> c.counts[(phase, "namespace::op")] = calls. `phase` is what
    `c.phase` was when the op ran (a planner counts a micro-batch apart from the step's once-only part);
    ops of a phase in `skip` are not counted."""

    def __init__(self, phase: str = "step"):
        super().__init__()
        self.phase = phase
        self.skip: set[str] = set()
        self.counts: Counter = Counter()
        self._hook = None
        self._entered = 0

    def __enter__(self):
        propagator = _sharding_propagator()
        if self._entered == 0 and propagator is not None:
            self._hook = Propagating(propagator._fake_mode_lock)
            propagator._fake_mode_lock = self._hook
        self._entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._entered -= 1
        if self._entered == 0 and self._hook is not None:
            _sharding_propagator()._fake_mode_lock = self._hook.inner
            self._hook = None
        return result

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        """Count what runs inside under `phase`."""
        before, self.phase = self.phase, phase
        try:
            yield self
        finally:
            self.phase = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_is_subclass(t) for t in types):
            return NotImplemented  # DTensor & co. desugar first: their local ops come back here
        if (self._hook is None or not self._hook.depth) and self.phase not in self.skip and not _is_query(func):
            self.counts[(self.phase, f"{func.namespace}::{func._overloadpacket.__name__}")] += 1
        return func(*args, **(kwargs or {}))

    def by_op(self, repeat: dict[str, int] | None = None) -> Counter:
        """"namespace::op" -> calls, each phase's counts times repeat[phase] (default 1)."""
        repeat = repeat or {}
        total: Counter = Counter()
        for (phase, op), calls in self.counts.items():
            total[op] += calls * repeat.get(phase, 1)
        return +total

    def ops(self, repeat: dict[str, int] | None = None) -> int:
        """Every op counted (each phase times repeat[phase], default 1)."""
        return sum(self.by_op(repeat).values())

    def kernel_ops(self, repeat: dict[str, int] | None = None) -> int:
        """The ops that launch a kernel on a GPU: all of them but NO_KERNEL's."""
        return sum(calls for op, calls in self.by_op(repeat).items() if op not in NO_KERNEL)
