"""Every check runs before a collective and names the key and the fix.

A fake process group gives a real 4-rank tp mesh in one process: a check that tried to
communicate would hang or fail here, and none does.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from plait.tensorparallel import (
    TensorParallelConfig,
    TensorParallelConfigError,
    apply_tensor_parallel,
    loss_parallel_context,
    uses_loss_parallel,
    validate_tensor_parallel,
)
from plait.tensorparallel.plan import path_matches


class Block(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(4)
        self.feed_forward = nn.Sequential()
        self.feed_forward.add_module("w1", nn.Linear(4, hidden, bias=False))
        self.feed_forward.add_module("w2", nn.Linear(hidden, 4, bias=False))


class Model(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(hidden), "1": Block(hidden)})


PLAN = {
    "layers.*.ffn_norm": "sequence_parallel",
    "layers.*.feed_forward": "prepare_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


@pytest.fixture
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_validate_names_the_key_and_the_fix():
    info = {"tp_divisible": {"n_heads": 16, "n_kv_heads": 6, "vocab_size": 2048}}
    with pytest.raises(TensorParallelConfigError, match=r"parallelism.tp = 4 does not divide the model's n_kv_heads = 6"):
        validate_tensor_parallel(info, 4, 64, TensorParallelConfig())
    validate_tensor_parallel(info, 2, 64, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match=r"training.seq_len = 30 .* parallelism.tp = 4"):
        validate_tensor_parallel({}, 4, 30, TensorParallelConfig())
    validate_tensor_parallel({}, 4, 30, TensorParallelConfig(sequence_parallel=False))
    validate_tensor_parallel({}, 1, 7, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match="parallelism.tp"):
        validate_tensor_parallel({}, 0, 8, TensorParallelConfig())


def test_async_tp_needs_cuda(tp_mesh):
    with pytest.raises(TensorParallelConfigError, match=r"parallelism.async_tp .* needs CUDA"):
        validate_tensor_parallel({}, 4, 64, TensorParallelConfig(async_tp=True))
    with pytest.raises(TensorParallelConfigError, match=r"parallelism.async_tp .* needs CUDA"):
        apply_tensor_parallel(Model(), tp_mesh, PLAN, TensorParallelConfig(async_tp=True))


def test_pattern_matching_nothing_is_named(tp_mesh):
    plan = {**PLAN, "layers.*.attention.wq": "colwise"}
    with pytest.raises(TensorParallelConfigError, match=r"'layers.\*.attention.wq': 'colwise' matches no module"):
        apply_tensor_parallel(Model(), tp_mesh, plan, TensorParallelConfig())


def test_structural_checks(tp_mesh):
    with pytest.raises(TensorParallelConfigError, match=r"layers.0.feed_forward.w1.*out_features = 6 .*tp = 4"):
        apply_tensor_parallel(Model(hidden=6), tp_mesh, PLAN, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match="unknown tensor-parallel plan string 'colwize'"):
        apply_tensor_parallel(Model(), tp_mesh, {**PLAN, "layers.*.feed_forward.w1": "colwize"}, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match="needs an torch.nn.Linear"):
        apply_tensor_parallel(Model(), tp_mesh, {**PLAN, "layers.*.ffn_norm": "colwise"}, TensorParallelConfig())
    no_region = {k: v for k, v in PLAN.items() if v != "prepare_input"}
    with pytest.raises(TensorParallelConfigError, match="must sit inside a module marked 'prepare_input'"):
        apply_tensor_parallel(Model(), tp_mesh, no_region, TensorParallelConfig())
    uncovered = {k: v for k, v in PLAN.items() if "norm" not in k}
    with pytest.raises(TensorParallelConfigError, match=r"parameter 'layers.0.ffn_norm.weight' is not covered"):
        apply_tensor_parallel(Model(), tp_mesh, uncovered, TensorParallelConfig())
    twice = {**PLAN, "layers.0.ffn_norm": "replicate"}
    with pytest.raises(TensorParallelConfigError, match="matched by two tensor-parallel plan entries"):
        apply_tensor_parallel(Model(), tp_mesh, twice, TensorParallelConfig())


def test_external_modules_are_skipped(tp_mesh):
    config = TensorParallelConfig(external_modules=("layers.*.ffn_norm",))
    model = apply_tensor_parallel(Model(), tp_mesh, PLAN, config)
    assert not hasattr(model.layers["0"].ffn_norm.weight, "placements")
    assert model.layers["0"].feed_forward.w1.weight.placements[0].is_shard(0)


def test_a_size_one_mesh_leaves_the_model_alone():
    model = Model()
    assert apply_tensor_parallel(model, None, {"nothing.*": "colwise"}, TensorParallelConfig()) is model


def test_path_matching_is_per_component():
    assert path_matches("layers.*.attention", "layers.12.attention")
    assert not path_matches("layers.*.attention", "layers.1.block.attention")
    assert not path_matches("layers.*", "layers.1.attention")


def test_loss_parallel_switch():
    plan = {"output": "output_colwise"}
    assert uses_loss_parallel(plan, TensorParallelConfig(), 2)
    assert not uses_loss_parallel(plan, TensorParallelConfig(loss_parallel=False), 2)
    assert not uses_loss_parallel(plan, TensorParallelConfig(), 1)
    assert not uses_loss_parallel({"output": "colwise"}, TensorParallelConfig(), 2)
    with loss_parallel_context(False):
        pass


class Head(nn.Module):
    """A loss head's shape (`weight` [V, D], no nn.Linear) as a model's `output`."""

    def __init__(self, vocab):
        super().__init__()
        self.output = nn.Module()
        self.output.weight = nn.Parameter(torch.zeros(vocab, 4))


def test_loss_head_shards_the_vocabulary_and_is_checked(tp_mesh):
    plan = {"output": "loss_head"}
    model = apply_tensor_parallel(Head(8), tp_mesh, plan, TensorParallelConfig())
    assert model.output.weight.placements[0].is_shard(0) and model.output.weight.to_local().shape == (2, 4)
    assert not uses_loss_parallel(plan, TensorParallelConfig(), 4)  # it computes its own vocab-parallel loss
    with pytest.raises(TensorParallelConfigError, match=r"'loss_head' shards the vocabulary \(weight.shape\[0\]\) = 6"):
        apply_tensor_parallel(Head(6), tp_mesh, plan, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match="'loss_head' needs a module with a 2-D `weight`"):
        apply_tensor_parallel(Model(), tp_mesh, {**PLAN, "layers.*.ffn_norm": "loss_head"}, TensorParallelConfig())


def test_meta_model_is_sharded_without_materialising(tp_mesh):
    import torch

    with torch.device("meta"):
        model = Model()
    apply_tensor_parallel(model, tp_mesh, PLAN, TensorParallelConfig())
    w1 = model.layers["1"].feed_forward.w1.weight
    assert w1.is_meta and w1.to_local().shape == (2, 4) and w1.shape == (8, 4)
    assert model.layers["1"].ffn_norm.weight.placements[0].is_replicate()


class KeywordFFN(nn.Module):
    """Called like transformers' modules: by keyword, with extra arguments through **kwargs."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)

    def forward(self, hidden_states=None, **kwargs):
        return self.w2(self.w1(hidden_states))


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn = KeywordFFN()


KEYWORD_PLAN = {"ffn": "prepare_input(hidden_states)", "ffn.w1": "colwise", "ffn.w2": "rowwise"}


def test_malformed_plan_strings_are_named(tp_mesh):
    for bad in ("prepare_input(", "prepare_input()", "prepare_input(a, b)", "prepare_input(a)(b)", " colwise"):
        with pytest.raises(TensorParallelConfigError, match=r"malformed tensor-parallel plan string .*prepare_input\("):
            apply_tensor_parallel(KeywordModel(), tp_mesh, {**KEYWORD_PLAN, "ffn": bad}, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match=r"unknown tensor-parallel plan string 'prepare_inputs\(x\)'"):
        apply_tensor_parallel(KeywordModel(), tp_mesh, {**KEYWORD_PLAN, "ffn": "prepare_inputs(x)"}, TensorParallelConfig())
    with pytest.raises(TensorParallelConfigError, match=r"'colwise\(x\)': only prepare_input and moe_input_output take"):
        apply_tensor_parallel(KeywordModel(), tp_mesh, {**KEYWORD_PLAN, "ffn.w1": "colwise(x)"}, TensorParallelConfig())


def test_an_argument_forward_does_not_take_is_named(tp_mesh):
    # nn.Sequential.forward(input) takes no **kwargs: a wrong name is caught before any collective.
    plan = {**PLAN, "layers.*.feed_forward": "prepare_input(hidden_states)"}
    with pytest.raises(
        TensorParallelConfigError,
        match=r"plan entry 'layers.0.feed_forward': 'prepare_input\(hidden_states\)' names argument 'hidden_states', "
        r"which Sequential.forward does not take \(it takes input\)",
    ):
        apply_tensor_parallel(Model(), tp_mesh, plan, TensorParallelConfig())
    apply_tensor_parallel(Model(), tp_mesh, {**PLAN, "layers.*.feed_forward": "prepare_input(input)"}, TensorParallelConfig())


def test_a_named_argument_missing_at_call_time_is_named(tp_mesh):
    import torch

    # The hook raises before entering the region, so no collective runs (the fake group could not).
    model = apply_tensor_parallel(KeywordModel(), tp_mesh, KEYWORD_PLAN, TensorParallelConfig())
    x = torch.zeros(2, 4, 4)
    with pytest.raises(
        TypeError,
        match=r"plan entry 'ffn': 'prepare_input\(hidden_states\)' on KeywordFFN converts argument 'hidden_states', "
        r"but the module was called without it \(0 positional, keywords: states\)",
    ):
        model.ffn(states=x)
    with pytest.raises(TypeError, match=r"'prepare_input\(hidden_states\)' on KeywordFFN .* got NoneType"):
        model.ffn(hidden_states=None)
    plain = apply_tensor_parallel(KeywordModel(), tp_mesh, {**KEYWORD_PLAN, "ffn": "prepare_input"}, TensorParallelConfig())
    with pytest.raises(TypeError, match=r"plan entry 'ffn': 'prepare_input' on KeywordFFN converts the first positional .*"
                       r"name the argument in the plan"):
        plain.ffn(hidden_states=x)
