"""Run torchtitan's trainer (0.3.0, or 0.2.2) on one GPU at a reduced depth, for benchmarks/gpu.py.

    python torchtitan_gpu.py --layers N --module M --config C <torchtitan 0.3.0 args>
    python torchtitan_gpu.py --layers N --config C <torchtitan 0.2.2 args>
    python torchtitan_gpu.py --check-args --layers N ...      parse only (gpu/lease.sh --dry-run)

Which of the two it drives is the torchtitan that `import torchtitan` finds (gpu.py puts the one
that fits the running torch first on PYTHONPATH: 0.3.0 needs torch >= 2.12, 0.2.2 runs before).
torchtitan builds a flavor's layer list in Python, so its command line cannot shorten a shipped
model, and it ships no Llama 3 1B trainer config. This launcher adds both and touches nothing else:

  * `--layers N` keeps the first N blocks of the flavor (DeepSeek-V3: the dense ones first, as
    plait's `--model.n_layers` does). Their inits stay the full model's depth-scaled ones, which a
    throughput run does not notice. 0.3.0: the flavor's layer list cut; 0.2.2: the flavor's model
    args' `n_layers` (its DeepSeek-V3 builds blocks 0..n_dense_layers-1 dense, the rest MoE).
  * `--config llama3_1b`: torchtitan's Llama 3 8B trainer config (bf16, selective AC) with a Llama
    3.2 1B model and, in 0.3.0, that model's vocabulary for the loss. 0.2.2 has no 1B flavor: one
    is registered with Llama 3.2 1B's dims (untied output: 0.2.2's Llama 3 ties no weights).
  * 0.2.2 only: `--config C` names its job config (`llama3_8b`, `llama3_1b`, `deepseek_v3_16b`).
    0.2.2 reads them from TOML files (`--job.config_file`) that its wheel does not ship; the
    values of its repository's torchtitan/models/<model>/train_configs/<C>.toml at v0.2.2 are
    below and stand in for the file (a `--job.config_file` given still wins).

Two more make its run the same work as plait's (gpu.py passes both):

  * `--attention-mask causal` (0.2.2): every flavor's attention over the whole causal row, as
    plait's causal runs. 0.2.2's DeepSeek-V3 16B defaults to flex attention with a block-causal
    mask (documents split at EOS), less work than causal; its kernel (flex) is kept, its mask made
    causal. 0.3.0's language models take only the block-causal mask: its line says so.
  * `--sac-save plait`: torchtitan's selective AC keeps what plait's does
    (plait.trainer.activation_checkpoint, `PLAIT_SAVE_OPS` below): every matmul, grouped GEMM and
    attention output saved. torchtitan's own op policy recomputes every second matmul (and the
    router's) and, for DeepSeek-V3, every expert GEMM (`_grouped_mm` is not in its save list):
    more recompute than plait does. Its other rules (what else it saves) stay.

Everything else is torchtitan's own CLI (gpu.py passes the local text folder, the tokenizer, the
sequence length, batch, steps, compile and, for DeepSeek-V3 on one GPU, expert parallel 1).
It prints one line of what the parse configured (layers, seq, compile, torchtitan's whole-step
CUDA graph on or off: 0.3.0's flavors' own default; 0.2.2 has none; the torchtitan version, its
SAC save list and its attention), which gpu.py reads. `--check-args` parses the rest with
torchtitan's own parser (these additions included), prints that line and exits without training
(0.2.2: after building the model on the meta device, to show the blocks kept): the lease's dry
run checks its command lines on a CPU.

On one GPU (data-parallel degree 1) 0.3.0 still wraps the model in FSDP (bf16 parameters for
compute, fp32 kept), while 0.2.2 applies no FSDP there and runs the step under bf16 autocast over
fp32 parameters: each version's own one-GPU default.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

from torchtitan_022_configs import DEEPSEEK_V3_16B_022, LLAMA3_8B_022  # 0.2.2's job configs

# plait's selective AC save list (plait.trainer.activation_checkpoint._SAVE_OPS, less plait's own
# ops, which torchtitan never calls), by name: tests/test_combo_lease_figures.py keeps them equal.
PLAIT_SAVE_OPS = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default", "aten._grouped_mm.default",
    "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default", "_c10d_functional.all_to_all_single.default",
)  # fmt: skip


def torchtitan_version() -> str:
    """The version of the torchtitan that `import torchtitan` finds, without importing it (0.2.2's
    import pulls in triton): its dist-info, else its layout (0.3.0 has torchtitan/trainer.py)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            raise SystemExit("torchtitan_gpu.py: torchtitan is not importable") from None
        return "0.3.0" if (Path(spec.origin).parent / "trainer.py").exists() else "0.2.2"


def _legacy(version: str) -> bool:
    """torchtitan before 0.3: TOML job configs, TrainSpec model args (0.2.2's API)."""
    return version.startswith(("0.1.", "0.2."))


def _configured(layers: int, t, compile_: bool, graphs: bool, profiling: bool, version: str, extra: str = "") -> None:
    print(f"torchtitan_gpu.py: {layers} layers, seq {t.seq_len}, batch {t.local_batch_size}, {t.steps} steps, "
          f"compile {compile_}, CUDA graphs {graphs}, profiling {profiling}, torchtitan {version}{extra}",
          flush=True)  # fmt: skip


# ---- torchtitan 0.3.0 -------------------------------------------------------------------------


def _add_llama3_1b() -> None:
    import torchtitan.models.llama3.config_registry as registry
    from torchtitan.models.llama3 import model_registry

    def llama3_1b():
        config = registry.llama3_8b()
        config.model_spec = model_registry("1B")
        config.loss.loss_fn.global_vocab_size = registry.decoder_vocab_size(config.model_spec)
        config.hf_assets_path = "./assets/hf/Llama-3.2-1B"
        return config

    registry.llama3_1b = llama3_1b


def _install_030(known: argparse.Namespace, rest: list[str], version: str) -> None:
    from torchtitan.config import ConfigManager

    _add_llama3_1b()
    parse = ConfigManager.parse_args

    def parse_args(self, args=None):
        config = parse(self, rest)
        if known.layers is not None:
            layers = config.model_spec.model.layers
            if not 0 < known.layers <= len(layers):
                raise SystemExit(f"--layers {known.layers}: the flavor has {len(layers)} layers")
            config.model_spec.model.layers = layers[: known.layers]
        t = config.training
        # 0.3.0's language models: block-causal masks only (its get_attention_config); no causal one.
        extra = f"{_sac_note(known)}, attention block_causal"
        _configured(len(config.model_spec.model.layers), t, config.compile.enable, not t.disable_cuda_graphs,
                    config.profiler.enable_profiling, version, extra)  # fmt: skip
        return config

    ConfigManager.parse_args = parse_args


# ---- torchtitan 0.2.2 -------------------------------------------------------------------------

_JOB_CONFIGS_022 = {"llama3_8b": LLAMA3_8B_022, "llama3_1b": LLAMA3_8B_022, "deepseek_v3_16b": DEEPSEEK_V3_16B_022}


def _job_config_022(name: str) -> dict:
    import tomllib

    if name not in _JOB_CONFIGS_022:
        raise SystemExit(f"--config {name}: torchtitan 0.2.2 runs here one of {', '.join(_JOB_CONFIGS_022)}")
    values = tomllib.loads(_JOB_CONFIGS_022[name])
    if name == "llama3_1b":
        values["job"]["description"] = "Llama 3.2 1B training"
        values["model"].update(flavor="1B", hf_assets_path="./assets/hf/Llama-3.2-1B")
    return values


def _add_llama3_1b_022() -> None:
    """Llama 3.2 1B as a flavor of 0.2.2's Llama 3 (its HF config's dims and RoPE scaling)."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    llama3_args.setdefault("1B", TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
        rope_theta=500000, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0)))  # fmt: skip


def _model_args_022(config):
    """The flavor's model args object the trainer will build from (get_train_spec hands out the
    model package's own flavor table, so a change here is what the trainer sees)."""
    from torchtitan.protocols.train_spec import get_train_spec

    flavors = get_train_spec(config.model.name).model_args
    if config.model.flavor not in flavors:
        raise SystemExit(f"--model.flavor {config.model.flavor}: {config.model.name} has {', '.join(flavors)}")
    return flavors[config.model.flavor]


def _install_022(known: argparse.Namespace, rest: list[str], version: str) -> None:
    from torchtitan.config import ConfigManager

    values = _job_config_022(known.config) if known.config else None
    load, parse = ConfigManager._maybe_load_toml, ConfigManager.parse_args

    def _maybe_load_toml(self, args):
        return load(self, args) or values  # a --job.config_file given wins

    def parse_args(self, args=None):
        config = parse(self, rest)
        model_args = _model_args_022(config)
        if known.layers is not None:
            if not 0 < known.layers <= model_args.n_layers:
                raise SystemExit(f"--layers {known.layers}: the flavor has {model_args.n_layers} layers")
            model_args.n_layers = known.layers
        if known.attention_mask == "causal" and hasattr(model_args, "attn_mask_type"):
            model_args.attn_mask_type = "causal"  # DeepSeek-V3 16B's flex keeps its kernel, not its EOS split
        attention = f"{getattr(model_args, 'attn_type', '?')} {getattr(model_args, 'attn_mask_type', '?')}"
        extra = f"{_sac_note(known)}, attention {attention}"
        _configured(model_args.n_layers, config.training, config.compile.enable, False,
                    config.profiling.enable_profiling, version, extra)  # fmt: skip
        return config

    _add_llama3_1b_022()
    ConfigManager._maybe_load_toml = _maybe_load_toml
    ConfigManager.parse_args = parse_args


def _check_model_022(config) -> None:
    """--check-args: build the cut model on the meta device, as the trainer will, and say which
    blocks it kept (dense / MoE) and its parameter count."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    model_args = _model_args_022(config)
    model_args.update_from_config(config)
    with torch.device("meta"):
        model = get_train_spec(config.model.name).model_cls(model_args)
    moe = sum(1 for block in model.layers.values() if getattr(block, "moe_enabled", False))
    params = sum(p.numel() for p in model.parameters())
    print(f"torchtitan_gpu.py check: built on meta: {len(model.layers)} blocks ({len(model.layers) - moe} dense, "
          f"{moe} MoE), {params / 1e9:.2f} B parameters", flush=True)  # fmt: skip


def _triton_stub() -> None:
    """0.2.2 imports its MoE Triton kernels (torchtitan/models/moe/kernels.py) with `import
    torchtitan` itself. On a CPU without triton (the dry run) that one module executes with a stub
    `triton` in sys.modules, taken out again right after, so nothing else (torch's inductor
    included) ever sees it. No kernel runs in a parse."""
    import importlib.abc
    import importlib.machinery

    if importlib.util.find_spec("triton") is not None:
        return
    kernels = "torchtitan.models.moe.kernels"

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Stub(name)

        def __call__(self, *args, **kwargs):  # triton.jit(fn) is fn; any other call a stub
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != kernels:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                stub = Stub("triton")
                stub.language = Stub("triton.language")
                sys.modules["triton"], sys.modules["triton.language"] = stub, stub.language
                try:
                    run(module)
                finally:
                    del sys.modules["triton"], sys.modules["triton.language"]

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


# ---- both -------------------------------------------------------------------------------------


def _sac_note(known: argparse.Namespace) -> str:
    return ", SAC plait's save list" if known.sac_save == "plait" else ", SAC its own"


def save_like_plait() -> None:
    """torchtitan's selective-AC policy, with every op of PLAIT_SAVE_OPS saved: the
    `create_selective_checkpoint_contexts` it makes each block's policy with wraps that policy
    (0.2.2 imports it from torch.utils.checkpoint when it applies SAC, 0.3.0 holds it in its
    module: both are wrapped, in this process only). The policy is still asked first (its mm
    counters stay in step); its other decisions stand."""
    import torch
    import torch.utils.checkpoint as checkpoint
    from torch.utils.checkpoint import CheckpointPolicy

    save = set()
    for name in PLAIT_SAVE_OPS:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            save.add(getattr(packet, overload))

    def wrap(make):
        def contexts(policy, *args, **kwargs):
            def plait_policy(ctx, func, *op_args, **op_kwargs):
                decision = policy(ctx, func, *op_args, **op_kwargs)
                return CheckpointPolicy.MUST_SAVE if func in save else decision

            return make(plait_policy, *args, **kwargs)

        return contexts

    import torchtitan.distributed.activation_checkpoint as ac

    for module in (checkpoint, ac):
        if hasattr(module, "create_selective_checkpoint_contexts"):
            module.create_selective_checkpoint_contexts = wrap(module.create_selective_checkpoint_contexts)


def install(argv: list[str]) -> str:
    """Make torchtitan's ConfigManager parse `argv` with this launcher's additions; the torchtitan
    version found."""
    ours = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ours.add_argument("--layers", type=int)
    ours.add_argument("--attention-mask", choices=("causal",))
    ours.add_argument("--sac-save", choices=("plait",))
    version = torchtitan_version()
    if _legacy(version):  # 0.3.0's --config is its own option: left in `rest` there
        ours.add_argument("--config")
    known, rest = ours.parse_known_args(argv)
    (_install_022 if _legacy(version) else _install_030)(known, rest, version)
    if known.sac_save == "plait":
        save_like_plait()
    return version


def check(argv: list[str]) -> None:
    """Parse `argv` as a run would, print what it configured (install's line), train nothing."""
    import torch

    version = torchtitan_version()
    if _legacy(version):
        _triton_stub()
    elif not torch.cuda.is_available():
        import torchtitan_cpu  # noqa: F401  (its triton stub lets the MoE models import without triton)
    install(argv)
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args()
    if _legacy(version):
        _check_model_022(config)


if __name__ == "__main__":
    if "--check-args" in sys.argv:
        check([a for a in sys.argv[1:] if a != "--check-args"])
        sys.exit(0)
    if _legacy(install(sys.argv[1:])):
        from torchtitan.train import Trainer, main

        sys.argv[0] = "torchtitan.train"
        main(Trainer)
    else:
        from torchtitan.train import main

        sys.argv[0] = "torchtitan.train"
        main()
