"""Run torchtitan 0.3.0's trainer on one GPU at a reduced depth, for benchmarks/gpu.py.

    python torchtitan_gpu.py --layers N --module M --config C <torchtitan args>
    python torchtitan_gpu.py --check-args --layers N ...      parse only (gpu/lease.sh --dry-run)

torchtitan builds a flavor's layer list in Python, so its command line cannot shorten a shipped
model, and it ships no Llama 3 1B trainer config. This launcher adds both and touches nothing else:

  * `--layers N` keeps the first N blocks of the flavor's layer list (DeepSeek-V3: the dense ones
    first, as plait's `--model.n_layers` does). Their inits stay the full model's depth-scaled
    ones, which a throughput run does not notice.
  * `--config llama3_1b`: torchtitan's Llama 3 8B trainer config (bf16 FSDP, selective AC) with
    its own Llama 3.2 1B model and that model's vocabulary for the loss.

Everything else is torchtitan's own CLI (gpu.py passes the local text folder, the tokenizer, the
sequence length, batch, steps, compile and, for DeepSeek-V3 on one GPU, expert parallel 1).
It prints one line of what the parse configured (layers, seq, compile, torchtitan's whole-step
CUDA graph on or off: its flavors' own default), which gpu.py reads. `--check-args` parses the
rest with torchtitan's own parser (these additions included), prints that line and exits without
training: the lease's dry run checks its command lines on a CPU.
"""

from __future__ import annotations

import argparse
import sys


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


def install(argv: list[str]) -> None:
    """Make torchtitan's ConfigManager parse `argv` with this launcher's two additions."""
    from torchtitan.config import ConfigManager

    ours = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ours.add_argument("--layers", type=int)
    known, rest = ours.parse_known_args(argv)
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
        print(f"torchtitan_gpu.py: {len(config.model_spec.model.layers)} layers, seq {t.seq_len}, batch "
              f"{t.local_batch_size}, {t.steps} steps, compile {config.compile.enable}, CUDA graphs "
              f"{not t.disable_cuda_graphs}, profiling {config.profiler.enable_profiling}", flush=True)
        return config

    ConfigManager.parse_args = parse_args


def check(argv: list[str]) -> None:
    """Parse `argv` as a run would, print what it configured (install's line), train nothing."""
    import torch

    if not torch.cuda.is_available():
        import torchtitan_cpu  # noqa: F401  (its triton stub lets the MoE models import without triton)
    install(argv)
    from torchtitan.config import ConfigManager

    ConfigManager().parse_args()


if __name__ == "__main__":
    if "--check-args" in sys.argv:
        check([a for a in sys.argv[1:] if a != "--check-args"])
        sys.exit(0)
    install(sys.argv[1:])
    from torchtitan.train import main

    sys.argv[0] = "torchtitan.train"
    main()
