"""Export a plait-train checkpoint to Hugging Face safetensors:

    python -m plait.trainer.checkpoint.hf_export --checkpoint outputs/run/checkpoints/step-000020 \\
        --output hf/ [--dtype bfloat16] [--model llama3 --flavor debugmodel]

reads the model part of the DCP checkpoint in this one process (plait.checkpoint.hf_export), with
the model arguments the run recorded (its `[model]` overrides, resolved as plait-train resolves
them) and writes `config.json` + safetensors that `transformers` loads. The model and flavor
default to those recorded in the checkpoint's marker.
"""

import argparse
import sys
from pathlib import Path

from plait.checkpoint import hf_output, store
from plait.checkpoint.hf_export import DTYPES, NOT_RECORDED, export, read_model_state, spec_and_args

__all__ = ["NOT_RECORDED", "main", "recorded_args"]


def recorded_args(model: str, flavor: str, meta: dict):
    """The model arguments a checkpoint was trained with (its flavor after the run's overrides),
    or None for checkpoints that predate the record (the flavor's own)."""
    saved = meta.get("model_args")
    if not saved:
        return None
    from ..config import build_config
    from ..model_args import resolve_model_args

    config = build_config({}, [])
    config.model.name, config.model.flavor = model, flavor
    spec, _ = spec_and_args(model, flavor)
    config.model.args = {k: v for k, v in saved.items() if k not in NOT_RECORDED}
    try:
        return resolve_model_args(config, spec)
    except ValueError as e:  # ConfigError: a field this version of the model does not have
        raise store.CheckpointError(f"the model arguments recorded in the checkpoint do not fit {model} ({e})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plait.trainer.checkpoint.hf_export",
        description="Export a plait checkpoint (DCP, any layout) to Hugging Face safetensors.",
    )
    parser.add_argument("--checkpoint", required=True, help="a step-NNNNNN checkpoint folder")
    parser.add_argument("--output", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--model", help="model name (default: the one recorded in the checkpoint)")
    parser.add_argument("--flavor", help="model flavor (default: the one recorded in the checkpoint)")
    args = parser.parse_args(argv)
    try:
        # Before anything is read: the output must not be (or hold) the checkpoint or its run.
        hf_output.check_output(args.output, "--output", protected=[Path(args.checkpoint)])
        state_dict, meta = read_model_state(args.checkpoint)
        model = args.model or meta.get("model")
        flavor = args.flavor or meta.get("flavor")
        if not model or not flavor:
            raise store.CheckpointError(
                f"checkpoint {args.checkpoint} does not record its model: pass --model and --flavor"
            )
        # The arguments it was trained with (its [model] overrides too); only with its own model.
        same = model == meta.get("model") and flavor == meta.get("flavor")
        model_args = recorded_args(model, flavor, meta) if same else None
        origin = {"checkpoint": str(Path(args.checkpoint).resolve()), "step": meta.get("step")}
        try:
            out = export(state_dict, model, flavor, args.output, DTYPES[args.dtype], model_args, origin=origin)
        except ValueError as e:
            if isinstance(e, store.CheckpointError):
                raise
            # check_matches_model's first line names the first mismatch (and how many more).
            detail = str(e).splitlines()[0].split(": ", 1)[-1]
            recorded = ("with the model arguments it records" if model_args is not None else
                        "and records no model arguments (saved before they were): pass the --model / --flavor "
                        "it was trained with")
            raise store.CheckpointError(f"checkpoint {args.checkpoint} is not {model} {flavor} ({detail}) {recorded}"
                                        ) from None
    except (store.CheckpointError, ValueError, KeyError) as e:
        print(f"hf_export: error: {e}", file=sys.stderr)
        return 2
    print(f"hf_export: wrote {out} ({model} {flavor}, step {meta['step']}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
