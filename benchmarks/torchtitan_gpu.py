"""Run torchtitan 0.3.0's trainer on one GPU at a reduced depth, for benchmarks/gpu.py.

    python torchtitan_gpu.py --layers N --module M --config C <torchtitan args>

torchtitan builds a flavor's layer list in Python, so its command line cannot shorten a shipped
model, and it ships no Llama 3 1B trainer config. This launcher adds both and touches nothing else:

  * `--layers N` keeps the first N blocks of the flavor's layer list (DeepSeek-V3: the dense ones
    first, as plait's `--model.n_layers` does). Their inits stay the full model's depth-scaled
    ones, which a throughput run does not notice.
  * `--config llama3_1b`: torchtitan's Llama 3 8B trainer config (bf16 FSDP, selective AC) with
    its own Llama 3.2 1B model and that model's vocabulary for the loss.

Everything else is torchtitan's own CLI (gpu.py passes the local text folder, the tokenizer, the
sequence length, batch, steps, compile and, for DeepSeek-V3 on one GPU, expert parallel 1).
"""

from __future__ import annotations

import sys


def _take_layers(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--layers N` (or `--layers=N`) out of argv."""
    rest, layers, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--layers" and i + 1 < len(argv):
            layers, i = int(argv[i + 1]), i + 2
            continue
        if argv[i].startswith("--layers="):
            layers = int(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    return layers, rest


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


def _truncate(config, layers: int):
    model = config.model_spec.model
    if not 0 < layers <= len(model.layers):
        raise SystemExit(f"--layers {layers}: the flavor has {len(model.layers)} layers")
    model.layers = model.layers[:layers]
    return config


def load_config(argv: list[str]):
    """torchtitan's parsed trainer config for `argv`, with this launcher's two additions."""
    from torchtitan.config import ConfigManager

    layers, rest = _take_layers(argv)
    _add_llama3_1b()
    config = ConfigManager().parse_args(rest)
    return _truncate(config, layers) if layers is not None else config


def main() -> None:
    from torchtitan.config import ConfigManager

    layers, rest = _take_layers(sys.argv[1:])
    _add_llama3_1b()
    if layers is not None:
        parse = ConfigManager.parse_args

        def parse_args(self, args=None):
            return _truncate(parse(self, rest), layers)

        ConfigManager.parse_args = parse_args
    from torchtitan.train import main as train

    sys.argv = ["torchtitan.train", *rest]
    train()


if __name__ == "__main__":
    main()
