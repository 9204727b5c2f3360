"""training.float8 (issue 42): bad settings fail in one line before anything starts; the linears
become torchao's Float8Linear with their names (the output head stays bf16); float8 changes the
loss, and each debug model trains near bf16 (the 300-step comparison is benchmarks/convergence_figures.py's);
a float8 checkpoint resumes with float8 off and exports the same Hugging Face names. The layouts are in the parity matrix (tests/)."""

import importlib.util
import json
import math

import pytest

from plait.testing.trainer import losses, run_cli, train_in_process
from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate

FLOAT8 = ["--training.dtype", "bfloat16", "--training.float8", "tensorwise", "--training.float8_filter", "divisible"]


def _config(*pairs):
    return build_config(None, list(zip(pairs[::2], pairs[1::2])))


def test_bad_float8_settings_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"training.float8 = rowwise needs training.dtype = bfloat16") as info:
        validate(_config("training.float8", "rowwise"), world_size=1)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"training.float8 = 'tensor'.*tensorwise"):
        _config("training.float8", "tensor")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs torchao: pip install 'plait-trainer\[float8\]'"):
        validate(_config("training.float8", "tensorwise", "training.dtype", "bfloat16"), world_size=1)


def test_bad_float8_experts_settings_are_one_line():
    deepseek = ("model.name", "deepseek_v3", "training.dtype", "bfloat16")
    refusals = {
        r"training.float8_experts = mxfp8: llama3 debugmodel has no routed experts; set it to off":
            ("training.dtype", "bfloat16", "training.float8_experts", "mxfp8"),
        r"training.float8_experts = mxfp8 needs training.dtype = bfloat16, not 'float32'":
            ("model.name", "deepseek_v3", "training.float8_experts", "mxfp8"),
        r"rowwise grouped GEMM needs a CUDA GPU of compute capability 8.9 or newer \(H100\); use mxfp8":
            (*deepseek, "training.float8_experts", "rowwise"),
        r"needs the experts' dims to be multiples of 32; this model's are dim 256 and hidden 48":
            (*deepseek, "training.float8_experts", "auto", "model.moe_inter_dim", "48"),
    }  # fmt: skip
    for message, pairs in refusals.items():
        with pytest.raises(ConfigError, match=message) as info:
            validate(_config(*pairs), world_size=1)
        assert "\n" not in str(info.value)


def test_float8_experts_dims_are_checked_on_the_expert_tensor_parallel_shard():
    """Issue 53: DeepSeek-V3 16B, mxfp8, etp 8 passed validation and the kernel got K = 176."""
    import torch

    from plait.trainer.float8_experts import check_float8_experts
    from plait.trainer.model_args import model_spec, resolve_model_args

    config = _config("model.name", "deepseek_v3", "model.flavor", "16B", "training.dtype", "bfloat16",
                     "training.float8_experts", "mxfp8")  # fmt: skip
    spec = model_spec(config)
    with torch.device("meta"):
        model = spec.model_cls(resolve_model_args(config, spec))
    experts = [model.get_submodule(p) for p in model.parallel_info()["experts"]]
    check_float8_experts(config, experts, None, device_known=False, etp=1)  # 2048 / 1408: multiples of 32
    with pytest.raises(ConfigError, match=r"hidden 176 \(1408 / parallelism.etp 8 on each rank\)") as info:
        check_float8_experts(config, experts, None, device_known=False, etp=8)
    assert "\n" not in str(info.value)


def test_float8_experts_pad_groups_to_32_rows_and_stay_close_to_bf16():
    """The experts' GEMMs go through torchao's MXFP8 grouped GEMM on rows padded to 32 per expert
    (the kernel's rule, kept on the CPU too), forward and backward, near the bf16 result."""
    import torch

    from plait.models.moe.experts import GroupedExperts
    from plait.trainer.float8_experts import ScaledGroupedMM

    torch.manual_seed(0)
    experts = GroupedExperts(dim=64, hidden_dim=96, num_experts=4)
    experts.init_weights(0.02)
    experts.to(torch.bfloat16)
    x_TD = torch.randn(50, 64, dtype=torch.bfloat16)
    counts_E = torch.tensor([7, 0, 30, 13])
    reference = experts(x_TD, counts_E)
    offsets_seen = []
    scaled = ScaledGroupedMM("mxfp8", emulate=True)

    def spy(x, w, offs):
        offsets_seen.append(offs.tolist())
        return scaled(x, w, offs)

    experts.grouped_mm, experts.group_alignment = spy, 32
    y_TD = experts(x_TD, counts_E)
    y_TD.float().square().sum().backward()
    assert offsets_seen and all(end % 32 == 0 for offs in offsets_seen for end in offs), offsets_seen
    error = ((y_TD.float() - reference.float()).norm() / reference.float().norm()).item()
    assert 0 < error < 0.1, error  # float8 acts, and stays near bf16 (measured 0.04)
    assert all(torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0 for w in (experts.w1, experts.w2, experts.w3))


def test_linears_become_float8_with_their_names_and_the_head_stays():
    from torchao.float8.float8_linear import Float8Linear

    from plait.trainer.float8 import convert_to_float8, describe

    plan = validate(_config("training.dtype", "bfloat16", "training.float8", "tensorwise",
                            "training.float8_filter", "divisible"), world_size=1)  # fmt: skip
    names = list(plan.model.state_dict())
    converted = convert_to_float8(plan.model, build_config(None, [("training.float8", "tensorwise"),
                                                                  ("training.float8_filter", "divisible")]),
                                  float8_all_gather=False, device_type="cpu")  # fmt: skip
    assert list(plan.model.state_dict()) == names
    assert "output" not in converted and not isinstance(plan.model.output, Float8Linear)
    assert all(isinstance(plan.model.get_submodule(path), Float8Linear) for path in converted)
    assert len(converted) == 7 * len(plan.model.layers)  # wq, wk, wv, wo, w1, w2, w3 per block
    assert "layers.*.attention.wq" in describe(converted, _config("training.float8", "tensorwise"))
    # torchao's rule (auto) keeps layers this small in bf16: refused in one line naming the fix
    # (issue 53: it ran in bf16 with a notice).
    with pytest.raises(ConfigError, match=r"training.float8 = rowwise: no linear of llama3 debugmodel qualifies "
                                          r"under training.float8_filter = auto .*--training.float8_filter divisible"):
        validate(_config("training.dtype", "bfloat16", "training.float8", "rowwise"), world_size=1)
    assert "no linear qualifies" in describe([], _config("training.float8", "rowwise"))


# The 300-step comparison the float8 issue asks for is benchmarks/convergence_figures.py's (RESULTS.md,
# "Convergence": the mean loss of steps 251-300, float8 against bf16, +0.013 % for Llama 3 and -0.69 %
# for DeepSeek-V3 with MXFP8 experts; 2026-11-29, 2-core EPYC, 300 steps each). Here the same settings
# run CONVERGENCE_STEPS steps (DeepSeek-V3 at the parity matrix's narrower attention: its 16-head MLA
# weights made the emulated float8 casts 5 of the pair's 6 minutes on that CPU, 2026-11-29), enough for
# a float8 that does not train, or trains off bf16's curve, to show. Measured there (steps 51-60,
# float8 against bf16): +0.089 % for Llama 3 (6.897 vs 6.891), +0.020 % for DeepSeek-V3 (6.781 vs
# 6.780), each 1.3 below its first loss; a fifth of the steps, of cheaper ones. The bound is
# the 300-step test's: a CPU with bf16 units takes torch's bf16 kernels, other numbers, and the
# DeepSeek-V3 float8 curve has gradient-norm spikes (+3.6 % at step 60 of a 300-step run).
CONVERGENCE_STEPS = 60
CONVERGENCE_WINDOW = 10  # the mean of the last 10 steps against bf16's
CONVERGENCE_REL = 0.05
NARROW_MLA = ["--model.n_heads", "8", "--model.kv_lora_rank", "128", "--model.qk_nope_head_dim", "32",
              "--model.qk_rope_head_dim", "32", "--model.v_head_dim", "32"]  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_float8_acts_and_trains_near_bf16(tmp_path, model):
    common = ["--model.name", model, "--model.n_layers", "2", "--training.seq_len", "32",
              "--training.local_batch_size", "2", "--training.steps", str(CONVERGENCE_STEPS),
              "--metrics.log_freq", "50", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
              "--optimizer.lr", "1e-3", *(NARROW_MLA if model == "deepseek_v3" else [])]  # fmt: skip
    bf16 = [r["loss"] for r in train_in_process(tmp_path / "bf16", *common, "--training.dtype", "bfloat16")]
    # DeepSeek-V3's experts run MXFP8 too (torchao's emulation on the CPU).
    experts = ["--training.float8_experts", "mxfp8"] if model == "deepseek_v3" else []
    float8 = [r["loss"] for r in train_in_process(tmp_path / "float8", *common, *FLOAT8, *experts)]
    assert len(bf16) == len(float8) == CONVERGENCE_STEPS
    assert any(a != b for a, b in zip(float8, bf16)), "float8 did not change the loss"
    window = CONVERGENCE_WINDOW
    last, ref = sum(float8[-window:]) / window, sum(bf16[-window:]) / window
    assert math.isfinite(last) and abs(last - ref) / ref < CONVERGENCE_REL, (model, last, ref)
    assert last < bf16[0] - 1.0, "float8 did not train"


def test_a_float8_checkpoint_resumes_without_float8_and_exports_the_same_names(tmp_path):
    dump = tmp_path / "run"
    args = ["--model.n_layers", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--metrics.tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
            "--metrics.log_freq", "1"]  # fmt: skip
    run_cli(dump, *args, *FLOAT8, "--training.steps", "2")
    resumed = run_cli(dump, *args, "--training.dtype", "bfloat16", "--training.steps", "3",
                      "--checkpoint.last_save_in_hf", "true")  # fmt: skip
    assert "plait-train: checkpoint: resuming from" in resumed.stdout and "(step 2, same layout" in resumed.stdout
    assert len(losses(dump)) == 3 and all(math.isfinite(loss) for loss in losses(dump))
    index = json.loads(next((dump / "checkpoints").glob("hf-step-*/model.safetensors.index.json")).read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"] and "lm_head.weight" in index["weight_map"]
    assert not any("float8" in name or "scale" in name for name in index["weight_map"])


def test_float8_linears_and_experts_compile(tmp_path):
    """training.compile with float8 linears and MXFP8 experts: Inductor compiles the float8 linears
    (torchao's emulation on the CPU) and the blocks around the experts, whose emulated grouped GEMMs
    run eagerly (float8_experts.py); the losses are the eager float8 run's within compile's noise."""
    # One block, a MoE one: float8 attention and shared-expert linears and MXFP8 routed experts in
    # the one graph Inductor compiles (with a dense block before it the test took ~130 s in CI).
    args = ["--model.name", "deepseek_v3", "--model.n_layers", "1", "--model.n_dense_layers", "0",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2", "--metrics.log_freq", "1",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false", *FLOAT8,
            "--training.float8_experts", "mxfp8"]  # fmt: skip
    eager = [r["loss"] for r in train_in_process(tmp_path / "eager", *args)]
    compiled = [r["loss"] for r in train_in_process(tmp_path / "compiled", *args, "--training.compile", "true")]
    assert len(compiled) == 2 and all(abs(a - b) / b < 2e-3 for a, b in zip(compiled, eager)), (compiled, eager)
