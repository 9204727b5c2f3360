"""Float8 training of the model's linears (training.float8), through torchao's Float8Linear.

The model file stays as written: the conversion swaps its nn.Linear modules for torchao's
Float8Linear (same parameters, same state-dict names), before tensor parallel and data parallel
are applied, so every layout shards the converted model. Each matmul then casts its operands to
float8 with scales computed on the device (tensorwise: one per tensor; rowwise: one per row) and
accumulates in higher precision; weights, gradients, optimizer state and checkpoints stay in high
precision, so a run resumes with float8 on or off and the Hugging Face export is unchanged.

Under FSDP / HSDP, tensorwise all-gathers the weights in float8 (half of bf16's bytes); their
scales are computed once per step, after the optimizer (`after_optimizer_step`: one all-reduce of
the weights' amax, on the device). The output layer stays in bf16 (its logits feed the loss), as
do layers `float8_filter` skips: torchao's rule (auto) skips those too small to gain on a GPU.
"""

import dataclasses
import importlib.util

from torch import nn

from plait.models import cpu_bf16

from .config import Config, ConfigError

# Module paths never converted: the output head's logits feed the loss.
KEEP_HIGH_PRECISION = ["output"]


def check_float8(config: Config) -> None:
    """The settings float8 needs, before anything is built (one line each)."""
    t = config.training
    if t.float8 == "off":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"training.float8 = {t.float8} needs torchao: pip install 'plait-trainer[float8]', "
                          "or set training.float8 = off.")
    if t.dtype != "bfloat16":
        raise ConfigError(f"training.float8 = {t.float8} needs training.dtype = bfloat16 (float8 matmuls on bf16 "
                          f"activations), not {t.dtype!r}.")


def _divisible(module: nn.Module, path: str) -> bool:
    """_scaled_mm's requirement: both dims multiples of 16."""
    if not isinstance(module, nn.Linear) or any(keep in path for keep in KEEP_HIGH_PRECISION):
        return False
    out_features, in_features = module.weight.shape
    return in_features % 16 == 0 and out_features % 16 == 0


def check_float8_linears(config: Config, model: nn.Module) -> None:
    """At least one linear of `model` (built on meta) passes training.float8_filter: a float8 run
    with none would compute in bf16 while saying float8."""
    t = config.training
    if t.float8 == "off":
        return
    from torchao.float8 import _auto_filter_for_recipe

    chosen = _auto_filter_for_recipe(t.float8, KEEP_HIGH_PRECISION) if t.float8_filter == "auto" else _divisible
    if any(chosen(module, path) for path, module in model.named_modules() if isinstance(module, nn.Linear)):
        return
    fix = ("use --training.float8_filter divisible (every linear with dims multiples of 16)"
           if t.float8_filter == "auto" else "its linears' dims are not multiples of 16")  # fmt: skip
    raise ConfigError(f"training.float8 = {t.float8}: no linear of {config.model.name} {config.model.flavor} qualifies "
                      f"under training.float8_filter = {t.float8_filter} (torchao's size rule keeps small layers in "
                      f"bf16): {fix}, or set training.float8 = off.")


def convert_to_float8(model: nn.Module, config: Config, float8_all_gather: bool, device_type: str) -> list[str]:
    """Swap the chosen linears of `model` (on meta or materialised) for Float8Linear; their paths.
    `float8_all_gather`: FSDP gathers the weights in float8 (tensorwise under FSDP / HSDP).

    On CPU the float8 matmuls are torchao's emulation: the same float8 operands and scales,
    dequantized, multiplied in fp32. torch's CPU `_scaled_mm` with a per-tensor scale takes a path
    ~1000x slower than its rowwise one (12.5 s against 11 ms for 2048 x 256 x 768, one thread of a
    2-core Xeon with AVX512-BF16 / AMX, torch 2.13; benchmarks/RESULTS.md), and
    torchao runs rowwise's backward matmuls through that per-tensor path too; the GPU runs
    `_scaled_mm` itself (the GPU lease measures it)."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

    t = config.training
    recipe = Float8LinearConfig.from_recipe_name(t.float8)
    if t.float8 == "tensorwise" and float8_all_gather:
        recipe = dataclasses.replace(recipe, enable_fsdp_float8_all_gather=True)
    if device_type == "cpu" and not cpu_bf16.GPU_ROUTE:  # plait-plan traces a GPU's step: its kernels
        recipe = dataclasses.replace(recipe, emulate=True)
    chosen = _auto_filter_for_recipe(t.float8, KEEP_HIGH_PRECISION) if t.float8_filter == "auto" else _divisible
    converted = []

    def keep(module: nn.Module, path: str) -> bool:
        if chosen(module, path):
            converted.append(path)
            return True
        return False

    convert_to_float8_training(model, config=recipe, module_filter_fn=keep)
    return converted


def describe(converted: list[str], config: Config) -> str:
    """One line for the start-up log: how many linears, which kinds."""
    kinds = sorted({".".join("*" if part.isdigit() else part for part in path.split(".")) for path in converted})
    if not converted:
        return (f"float8 {config.training.float8}: no linear qualifies (training.float8_filter = "
                f"{config.training.float8_filter}); the run computes in bf16")
    return f"float8 {config.training.float8}: {len(converted)} linears in float8 ({', '.join(kinds)})"


def after_optimizer_step(model: nn.Module) -> None:
    """Tensorwise under FSDP: the float8 weights' scales for the next step's all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def float8_flops_per_token(model: nn.Module, config: Config, experts: list[str] = ()) -> int:
    """FLOPs per token of the float8 matmuls (forward and both backward products: 6 x in x out per
    float8 linear; per float8 experts module, its three GEMMs for each of the top-k experts a token
    reaches), for the planner's time at the device's float8 peak."""
    flops = 0
    if config.training.float8 != "off":
        from torchao.float8.float8_linear import Float8Linear

        flops += sum(6 * m.in_features * m.out_features for m in model.modules() if isinstance(m, Float8Linear))
    if config.training.float8_experts != "off":
        for path in experts:
            moe, w1 = model.get_submodule(path.rsplit(".", 1)[0]), model.get_submodule(path).w1
            flops += 6 * 3 * w1.shape[1] * w1.shape[2] * moe.router.top_k
    return flops
