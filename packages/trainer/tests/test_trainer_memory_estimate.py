"""The per-rank peak-memory estimate (issue 27, defect 13): its shape in batch, sequence, vocab, AC
and sharding; a run that cannot fit refused in validate() with one line; the shipped configs fit
an 80 GiB GPU at the rank counts they are written for."""

import dataclasses
from unittest import mock

import pytest
import torch

from plait.mesh import ParallelDims
from plait.trainer import memory_estimate
from plait.trainer.config import ConfigError, _shipped_config, build_config, load_toml
from plait.trainer.memory_estimate import GIB, estimate_memory
from plait.trainer.model_args import model_spec, resolve_model_args
from plait.trainer.validate import validate


def _meta_model(config):
    spec = model_spec(config)
    with torch.device("meta"):
        model = spec.model_cls(resolve_model_args(config, spec))
    return model, model.parallel_info()


def _estimate(overrides=(), world_size=1, config=None):
    config = config or build_config(None, list(overrides))
    model, info = _meta_model(config)
    p = config.parallelism
    dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, ep=p.ep, etp=p.etp,
                        pp=p.pp, world_size=world_size)
    return estimate_memory(config, dims, model, info)


def test_estimate_grows_with_batch_seq_and_vocab():
    base = _estimate()
    batch = _estimate([("training.local_batch_size", "16")])
    seq = _estimate([("training.seq_len", "512")])
    vocab = _estimate([("model.vocab_size", "8192")])
    assert batch.activations == 2 * base.activations and batch.logits == 2 * base.logits
    assert seq.activations == 2 * base.activations and seq.states == base.states
    assert vocab.logits == 4 * base.logits and vocab.states > base.states
    # The logits part is tokens x vocab x (fp32 compute + fp32 log-softmax).
    assert base.logits == 8 * 256 * 2048 * (4 + 4)


def test_chunked_loss_counts_one_chunk_of_logits():
    base = _estimate([("model.vocab_size", "131072")])
    chunked = _estimate([("model.vocab_size", "131072"), ("training.loss", "chunked")])
    assert chunked.logits == 512 * 131072 * (4 + 4)  # auto: 2^26 elements / vocab = 512 tokens
    assert base.logits == 8 * 256 * 131072 * (4 + 4) and chunked.states == base.states
    tp2 = _estimate([("model.vocab_size", "131072"), ("training.loss", "chunked"), ("parallelism.tp", "2"),
                     ("parallelism.dp_shard", "1"), ("parallelism.loss_parallel", "false")], world_size=2)
    assert tp2.logits == chunked.logits / 2  # vocab-parallel chunks whatever loss_parallel says


def test_activation_checkpointing_lowers_activations():
    none = _estimate([("training.activation_checkpoint", "none")])
    selective = _estimate([("training.activation_checkpoint", "selective")])
    full = _estimate([("training.activation_checkpoint", "full")])
    assert full.activations < selective.activations < none.activations
    every2 = _estimate([("training.activation_checkpoint", "full"), ("training.activation_checkpoint_every", "2")])
    assert full.activations < every2.activations < none.activations
    assert full.states == none.states


def test_sharding_divides_model_state():
    one = _estimate()
    fsdp4 = _estimate([("parallelism.dp_shard", "4")], world_size=4)
    assert fsdp4.states == pytest.approx(one.states / 4, rel=1e-6)
    assert one.gathered == 0 and fsdp4.gathered > 0  # FSDP's unsharded units appear once it shards
    moe = _estimate(config=build_config(load_toml(str(_shipped_config("deepseek_v3_debugmodel.toml")))))
    moe_ep = _estimate(config=build_config(load_toml(str(_shipped_config("deepseek_v3_debugmodel.toml"))),
                                           [("parallelism.dp_shard", "4"), ("parallelism.ep", "4")]), world_size=4)
    assert moe_ep.states == pytest.approx(moe.states / 4, rel=1e-6)  # routed experts over ep x efsdp too
    assert moe.activations > 0 and moe.logits > 0


def test_tensor_parallel_divides_states_and_activations():
    one = _estimate()
    tp2 = _estimate([("parallelism.tp", "2"), ("parallelism.dp_shard", "1")], world_size=2)
    # Norm weights stay replicated: a little over half of the state, activations halved under SP.
    assert one.states / 2 < tp2.states < one.states * 0.52
    assert tp2.activations == pytest.approx(one.activations / 2, rel=0.01)
    assert tp2.logits == one.logits / 2  # loss_parallel


def test_validate_refuses_a_batch_that_cannot_fit_with_one_line(tmp_path):
    overrides = [("job.dump_folder", str(tmp_path)), ("training.local_batch_size", "4096")]
    config = build_config(None, overrides)
    with mock.patch.object(memory_estimate, "_available_host_memory", return_value=2 * GIB), \
            mock.patch("torch.cuda.is_available", return_value=False), pytest.raises(ConfigError) as err:
        validate(config, world_size=1, check_memory=True)
    msg = str(err.value)
    assert "\n" not in msg
    assert "estimated peak memory per rank" in msg and "2.0 GiB of available host memory" in msg
    assert "training.local_batch_size (4096)" in msg and "training.memory_check = false" in msg
    # Turned off, the same run passes validation; the default batch fits the same 2 GiB.
    with mock.patch.object(memory_estimate, "_available_host_memory", return_value=2 * GIB), \
            mock.patch("torch.cuda.is_available", return_value=False):
        assert validate(build_config(None, overrides + [("training.memory_check", "false")]), world_size=1,
                        check_memory=True)
        assert validate(build_config(None, [("job.dump_folder", str(tmp_path))]), world_size=1, check_memory=True)
        # A layout checked on another machine's behalf (no run starts here) is not held to this one's memory.
        assert validate(config, world_size=1)


def test_host_memory_is_shared_by_the_local_ranks():
    with mock.patch.object(memory_estimate, "_available_host_memory", return_value=8 * GIB), \
            mock.patch("torch.cuda.is_available", return_value=False):
        assert memory_estimate.device_memory(4)[0] == 2 * GIB
    assert memory_estimate._available_host_memory() > 0


# The rank counts each shipped config is written for (its comment, or the fewest 8-GPU nodes its
# degrees allow). The estimate errs low, so each must fit 90 % of an 80 GiB GPU at these counts.
SHIPPED_WORLDS = {
    "llama3_debugmodel": 1, "deepseek_v3_debugmodel": 1, "llama3_1B": 8, "llama3_3B": 8, "llama3_8B": 8,
    "llama3_8B_64k_cp": 8, "llama3_70B": 64, "llama3_405B": 512, "deepseek_v3_16B": 8,
    "deepseek_v3_236B": 256, "deepseek_v3_671B": 512, "kimi_k2": 512,
    "qwen3_debugmodel": 1, "qwen3_8B": 8, "qwen3_30B_A3B": 16, "qwen3_235B_A22B": 256,
}


@pytest.mark.parametrize("name", sorted(SHIPPED_WORLDS))
def test_shipped_configs_fit_an_80_gib_gpu(name):
    config = build_config(load_toml(str(_shipped_config(name + ".toml"))))
    world = SHIPPED_WORLDS[name]
    est = _estimate(config=config, world_size=world)
    assert 0 < est.total <= 0.9 * 80 * GIB, f"{name} at {world} ranks: {est.total / GIB:.1f} GiB {est.parts()}"
    model, info = _meta_model(config)
    dims = ParallelDims(**{f.name: getattr(config.parallelism, f.name) for f in dataclasses.fields(ParallelDims)
                           if f.name != "world_size"}, world_size=world)
    props = mock.Mock(total_memory=80 * GIB)
    props.name = "H100"
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=8), \
            mock.patch("torch.cuda.get_device_properties", return_value=props):
        assert memory_estimate.memory_problem(config, dims, model, info) is None


def test_pipeline_parallel_counts_its_stages_and_the_micro_batches_in_flight():
    """Under pp a rank holds its stages' blocks (model state about halves at pp 2) and the
    activations of the micro-batches its schedule keeps in flight: 8 for GPipe, 2 for 1F1B."""
    flags = [("model.n_layers", "4"), ("training.local_batch_size", "8"), ("parallelism.pipeline_microbatch_size", "1")]
    one = _estimate(flags)
    onef1b = _estimate([*flags, ("parallelism.pp", "2"), ("parallelism.pipeline_schedule", "1F1B")], world_size=2)
    gpipe = _estimate([*flags, ("parallelism.pp", "2"), ("parallelism.pipeline_schedule", "GPipe")], world_size=2)
    assert 0.4 * one.states < onef1b.states < 0.6 * one.states
    assert gpipe.activations > 3 * onef1b.activations
    # torch 2.13's Interleaved1F1B, pp 8 x 2 stages per rank, 16 micro-batches: 23 on rank 0
    # (the planner counts the same from torch's order: tests/test_combo_trainer_plan_pp.py).
    assert memory_estimate.pp_in_flight("Interleaved1F1B", 8, 2, 16) == 23
    assert memory_estimate.pp_in_flight("1F1B", 4, 1, 16, pp_rank=1) == 3


def test_bf16_optimizer_states_count_12_bytes_per_parameter():
    """optimizer.state_dtype = bf16: weight 4 + gradient 4 + two bf16 moments 4 = 12 of fp32's 16."""
    fp32 = _estimate()
    bf16 = _estimate([("optimizer.state_dtype", "bf16")])
    assert bf16.states * 16 == pytest.approx(fp32.states * 12, rel=1e-9)
    assert bf16.activations == fp32.activations and bf16.logits == fp32.logits
