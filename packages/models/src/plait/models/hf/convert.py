"""`plait-convert`: plait state dict <-> Hugging Face checkpoint directory.

    plait-convert to-hf   --model llama3 --flavor 8B --input ckpt/model.pt --output hf/ [--dtype bfloat16]
    plait-convert from-hf --model llama3 --input hf/ --output ckpt/model.pt [--flavor 8B] [--dtype float32]

The plait side is one plain state-dict file: `*.pt` / `*.pth` (torch.save of a dict of tensors,
or of {"model": that dict}) or `*.safetensors`. A directory input is searched for `model.pt`,
`model.safetensors` or a sharded `model.safetensors.index.json`; a directory output gets
`model.pt`. Distributed (DCP) checkpoints are the trainer's business: consolidate them first.
The HF side is a directory with `config.json` and (sharded) safetensors; block-FP8 weights
(DeepSeek-V3's release, `weight_scale_inv`) are dequantised on import.
"""

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

import torch

from plait.models.hf.checks import ImportCheckError, check_hf_state
from plait.models.hf.fp8 import dequantize_if_fp8
from plait.models.hf.io import (
    INDEX_FILE,
    SINGLE_FILE,
    load_safetensors,
    save_safetensors,
    save_safetensors_file,
)
from plait.models.registry import get_model_args, get_model_spec, list_models

PLAIT_PT_FILE = "model.pt"
# Model args a checkpoint does not fix (DeepSeek-V3's MTP depths and loss weight, how experts are balanced).
_TRAINING_CHOICES = ("mtp_layers", "mtp_loss_scale", "aux_loss_coeff", "load_balance_coeff")


def load_plait_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.is_dir():
        for candidate in (PLAIT_PT_FILE, SINGLE_FILE, INDEX_FILE):
            if (path / candidate).is_file():
                return load_plait_state_dict(path / candidate if candidate == PLAIT_PT_FILE else path)
        raise FileNotFoundError(f"no {PLAIT_PT_FILE}, {SINGLE_FILE} or {INDEX_FILE} in {path}")
    if path.suffix == ".safetensors" or path.name == INDEX_FILE:
        return load_safetensors(path if path.suffix == ".safetensors" else path.parent)
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded.get("model"), dict):
        loaded = loaded["model"]
    return loaded


def save_plait_state_dict(state_dict: dict[str, torch.Tensor], path: str | Path) -> Path:
    path = Path(path)
    if path.suffix == ".safetensors":
        return save_safetensors_file(state_dict, path)
    if path.suffix not in (".pt", ".pth"):
        path = path / PLAIT_PT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state_dict, path)
    return path


def check_matches_model(state_dict: dict[str, torch.Tensor], model_cls: type, args) -> None:
    """Fail early, naming the keys, if `state_dict` is not exactly `model_cls(args)`'s."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in model_cls(args).state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state_dict.items()}
    problems = [f"missing {k}" for k in expected.keys() - got.keys()]
    problems += [f"unexpected {k}" for k in got.keys() - expected.keys()]
    problems += [f"{k}: shape {got[k]} != {expected[k]}" for k in expected.keys() & got.keys() if got[k] != expected[k]]
    if problems:
        # The first line names a key (callers that keep one line keep it); the rest list up to 20.
        problems.sort()
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        shown = "\n  ".join(problems[:20])
        raise ValueError(f"state dict does not match {model_cls.__name__}: {problems[0]}{more}\n  {args}\n  {shown}")


def _parse_overrides(pairs: list[str], args_cls: type) -> dict:
    """--set key=value pairs -> typed ModelArgs overrides (e.g. --set vocab_size=32000)."""
    hints = typing.get_type_hints(args_cls)
    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in hints:
            raise SystemExit(f"--set: {args_cls.__name__} has no field {key!r}")
        overrides[key] = json.loads(value)
    return overrides


def to_hf(
    model: str,
    flavor: str,
    input: str,
    output: str,
    dtype: torch.dtype | None,
    max_shard_size: str,
    overrides: list[str],
) -> None:
    spec = get_model_spec(model)
    args = get_model_args(model, flavor, **_parse_overrides(overrides, type(spec.flavors[flavor])))
    state_dict = load_plait_state_dict(input)
    check_matches_model(state_dict, spec.model_cls, args)
    hf_state_dict = spec.hf_adapter.to_hf(state_dict, args)
    save_safetensors(hf_state_dict, output, max_shard_size=max_shard_size, dtype=dtype)
    config = spec.hf_adapter.hf_config(args)
    saved_dtype = dtype or next(iter(state_dict.values())).dtype
    config["torch_dtype"] = str(saved_dtype).removeprefix("torch.")
    (Path(output) / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def from_hf(model: str, flavor: str | None, input: str, output: str, dtype: torch.dtype | None) -> None:
    spec = get_model_spec(model)
    config = json.loads((Path(input) / "config.json").read_text())
    args = spec.hf_adapter.args_from_hf_config(config)
    if flavor is not None:
        expected = spec.flavors[flavor]
        # How many multi-token-prediction depths to train is the flavor's choice: fewer than the
        # checkpoint holds drops the rest, more fails below naming a missing key.
        args = dataclasses.replace(args, **{f: getattr(expected, f) for f in _TRAINING_CHOICES if hasattr(args, f)})
        # max_seq_len only sizes the RoPE tables; everything else must be the flavor's.
        if dataclasses.replace(args, max_seq_len=expected.max_seq_len, depth_init=expected.depth_init) != expected:
            raise SystemExit(f"{input}/config.json is not flavor {flavor!r}:\n  {args}\n  != {expected}")
    hf_state_dict = load_safetensors(input)
    check_hf_state(hf_state_dict, input)
    state_dict = spec.hf_adapter.from_hf(dequantize_if_fp8(hf_state_dict, config), args)
    check_matches_model(state_dict, spec.model_cls, args)
    if dtype is not None:
        state_dict = {name: t.to(dtype) for name, t in state_dict.items()}
    written = save_plait_state_dict(state_dict, output)
    print(f"wrote {written} for {model} {args}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"not a torch dtype: {name}")
    return dtype


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait-convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("to-hf", help="plait state dict -> HF directory")
    export.add_argument("--model", required=True, choices=list_models())
    export.add_argument("--flavor", required=True)
    export.add_argument("--input", required=True, help="model.pt / .safetensors file, or a directory")
    export.add_argument("--output", required=True, help="HF checkpoint directory to write")
    export.add_argument("--dtype", type=_dtype, default=None, help="e.g. bfloat16 (default: unchanged)")
    export.add_argument("--max-shard-size", default="5GB")
    export.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model arg of the flavor, value as JSON (repeatable)",
    )

    import_ = commands.add_parser("from-hf", help="HF directory -> plait state dict")
    import_.add_argument("--model", required=True, choices=list_models())
    import_.add_argument("--flavor", default=None, help="check config.json is this flavor")
    import_.add_argument("--input", required=True, help="HF checkpoint directory")
    import_.add_argument("--output", required=True, help="*.pt / *.safetensors file, or a directory")
    import_.add_argument("--dtype", type=_dtype, default=None, help="e.g. float32 (default: unchanged)")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "to-hf":
        to_hf(ns.model, ns.flavor, ns.input, ns.output, ns.dtype, ns.max_shard_size, ns.overrides)
    else:
        try:
            from_hf(ns.model, ns.flavor, ns.input, ns.output, ns.dtype)
        except ImportCheckError as e:  # a damaged or unconvertible tensor: one line, nothing written
            print(f"plait-convert: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
