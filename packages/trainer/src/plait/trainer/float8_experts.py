"""Float8 MoE experts (training.float8_experts): torchao's scaled grouped GEMMs for the routed experts.

The experts module stays as written: plait.models' GroupedExperts takes a replacement grouped GEMM
(`grouped_mm`) and a group alignment (docs/contracts.md); this file installs torchao's, before any
parallelism, so expert parallel's dispatchers pad every expert's rows to what the kernel needs:
    rowwise  float8 e4m3 with one scale per row (torch._scaled_grouped_mm; CUDA sm89+ like H100),
             groups of 16 rows;
    mxfp8    MX float8, one power-of-two scale per 32 elements (CUDA sm100 like B200 or GB200),
             groups of 32 rows; on a CPU torchao's emulation (the same MX operands, dequantized,
             multiplied in high precision).
    auto     mxfp8 on sm100 and on a CPU, rowwise on sm89 / sm90.
Weights, gradients, optimizer state and checkpoints stay in high precision, as for the linears.
"""

import importlib.util

import torch
from torch import nn

from .config import Config, ConfigError

# The kernels' multiple: of each expert group's rows, and of each GEMM's inner and outer dims.
MULTIPLE = {"rowwise": 16, "mxfp8": 32}


def experts_recipe(config: Config, cuda_capability: tuple[int, int] | None) -> str:
    """The float8 kind the experts run: training.float8_experts with auto resolved for the device
    (`cuda_capability` None: a CPU)."""
    recipe = config.training.float8_experts
    if recipe != "auto":
        return recipe
    return "rowwise" if cuda_capability is not None and cuda_capability < (10, 0) else "mxfp8"


def check_float8_experts(config: Config, experts: list[nn.Module], cuda_capability: tuple[int, int] | None,
                         device_known: bool = True, etp: int = 1) -> None:
    """One line for each setting the float8 experts cannot run with, before anything is built.
    `device_known = False` (plait-plan, planning for another machine): no check of this device.
    `etp`: expert tensor parallel shards the experts' hidden dim, and the kernel sees the shard."""
    t = config.training
    if t.float8_experts == "off":
        return
    setting = f"training.float8_experts = {t.float8_experts}"
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{setting} needs torchao: pip install 'plait-trainer[float8]', or set it to off.")
    if t.dtype != "bfloat16":
        raise ConfigError(f"{setting} needs training.dtype = bfloat16, not {t.dtype!r}.")
    if not experts:
        raise ConfigError(f"{setting}: {config.model.name} {config.model.flavor} has no routed experts; set it to off.")
    recipe = experts_recipe(config, cuda_capability)
    if device_known:
        _check_device(setting, recipe, cuda_capability)
    w1 = experts[0].w1  # [E, dim, hidden]
    dim, hidden = w1.shape[1], w1.shape[2]
    shard = hidden // etp if hidden % etp == 0 else hidden / etp
    if dim % MULTIPLE[recipe] or shard % MULTIPLE[recipe]:
        per = f" ({hidden} / parallelism.etp {etp} on each rank)" if etp > 1 else ""
        raise ConfigError(f"{setting}: the {recipe} grouped GEMM needs the experts' dims to be multiples of "
                          f"{MULTIPLE[recipe]}; this model's are dim {dim} and hidden {shard:g}{per} (--model.dim / "
                          "--model.moe_inter_dim" + (", parallelism.etp" if etp > 1 else "") + "), or set it to off.")


def _check_device(setting: str, recipe: str, cuda_capability: tuple[int, int] | None) -> None:
    if recipe == "rowwise" and (cuda_capability is None or cuda_capability < (8, 9)):
        raise ConfigError(f"{setting}: torchao's float8 rowwise grouped GEMM needs a CUDA GPU of compute capability "
                          "8.9 or newer (H100); use mxfp8 (emulated on a CPU) or auto.")
    if recipe == "mxfp8" and cuda_capability is not None and cuda_capability < (10, 0):
        raise ConfigError(f"{setting}: the MXFP8 grouped GEMM needs compute capability 10.0 (B200); "
                          f"this GPU is {cuda_capability[0]}.{cuda_capability[1]}: use rowwise or auto.")


@torch.compiler.disable
def _eager(gemm, *args):
    return gemm(*args)


class ScaledGroupedMM:
    """`(x_MK, w_GKN, offs_G) -> y_MN` through torchao's float8 grouped GEMM with dynamic scales."""

    def __init__(self, recipe: str, emulate: bool):
        self.recipe, self.emulate = recipe, emulate

    def __call__(self, x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        if self.emulate:
            # Inductor fails on torchao 0.18's MXFP8 emulation (an internal layout assertion, torch
            # 2.13 CPU): under training.compile the emulated GEMMs run eagerly, the rest compiled.
            return _eager(self._gemm, x_MK, w_GKN, offs_G)
        return self._gemm(x_MK, w_GKN, offs_G)

    def _gemm(self, x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        # torchao's right operand is per-expert column-major (strides K*N, 1, K); plait stores each
        # expert's weight row-major so that x @ w needs no transpose: one copy here, read once by
        # the quantization that follows anyway.
        w_GKN = w_GKN.transpose(-2, -1).contiguous().transpose(-2, -1)
        if self.recipe == "rowwise":
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

            return _to_fp8_rowwise_then_scaled_grouped_mm(
                x_MK, w_GKN, offs_G, out_dtype=x_MK.dtype, pad_token_groups_for_grouped_mm=False
            )
        from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
        from torchao.quantization.quantize_.common import KernelPreference

        preference = KernelPreference.EMULATED if self.emulate else KernelPreference.AUTO
        return _to_mxfp8_then_scaled_grouped_mm(x_MK, w_GKN, offs_G, out_dtype=x_MK.dtype, kernel_preference=preference)

    def __repr__(self) -> str:
        return f"ScaledGroupedMM({self.recipe}{', emulated' if self.emulate else ''})"


def convert_experts_to_float8(model: nn.Module, experts: list[str], config: Config, device_type: str) -> str:
    """Install the float8 grouped GEMM on each experts module of `model`; one line for the log."""
    cuda_capability = torch.cuda.get_device_capability() if device_type == "cuda" else None
    recipe = experts_recipe(config, cuda_capability)
    gemm = ScaledGroupedMM(recipe, emulate=device_type != "cuda")
    for path in experts:
        module = model.get_submodule(path)
        module.grouped_mm = gemm
        module.group_alignment = max(module.group_alignment, MULTIPLE[recipe])
    how = " (torchao's emulation)" if gemm.emulate else ""
    return f"float8 experts {recipe}{how}: {len(experts)} experts modules, groups padded to {MULTIPLE[recipe]} rows"
