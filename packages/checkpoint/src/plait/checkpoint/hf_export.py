"""Checkpoints <-> Hugging Face safetensors, through plait-models' adapters.

`read_model_state` reads the model part of a DCP checkpoint in one process (no process group;
DCP assembles the full tensors from whatever layout saved them); `export` converts a full state
dict with the model's `to_hf` and writes `config.json` + safetensors that `transformers` loads;
`check_hf_folder` / `read_hf_state` go the other way. plait-train uses them for
`checkpoint.last_save_in_hf`, for starting a run from HF weights (`initial_load_hf`) and in its
`python -m plait.trainer.checkpoint.hf_export` command.
"""

import dataclasses
import json
from pathlib import Path

import torch

from . import hf_output, store

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def spec_and_args(model: str, flavor: str, model_args=None):
    """The model spec and its arguments: `model_args` when the run overrode the flavor's."""
    from plait.models import get_model_spec

    spec = get_model_spec(model)
    if flavor not in spec.flavors:
        raise store.CheckpointError(f"{model} has no flavor {flavor!r} (flavors: {', '.join(spec.flavors)})")
    return spec, model_args if model_args is not None else spec.flavors[flavor]


# Arguments that only size RoPE tables or shape the initialisation: not the trained model.
NOT_RECORDED = ("max_seq_len", "depth_init")


def args_record(model_args) -> dict | None:
    """A model's arguments as JSON values, as a checkpoint's marker records them."""
    if model_args is None:
        return None
    from plait.models import model_args_dict

    return json.loads(json.dumps(model_args_dict(model_args)))


def read_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model state dict of a checkpoint (CPU tensors, as saved) and its marker metadata."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    meta = store.check(path)
    problem = store.verify_checksums(path, meta)
    if problem:
        raise store.CheckpointError(problem)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = "model."
    template = {
        key[len(prefix) :]: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(item, "size")
    }
    if not template:
        raise store.CheckpointError(f"checkpoint {path} holds no model weights")
    state = {"model": template}
    with store.single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"], meta


def export(
    state_dict: dict[str, torch.Tensor], model: str, flavor: str, output: str | Path, dtype: torch.dtype,
    model_args=None, where: str = "--output", origin: dict | None = None,
) -> Path:
    """Write `state_dict` (plait names, full tensors) as a Hugging Face folder, atomically, into a
    new or empty folder or over an earlier export (hf_output.py; anything else is refused)."""
    from plait.models.hf.convert import check_matches_model
    from plait.models.hf.io import save_safetensors

    spec, args = spec_and_args(model, flavor, model_args)
    try:  # before anything is written: a model Hugging Face cannot load (softmax routing) names its fix
        spec.hf_adapter.hf_config(args)
    except ValueError as e:
        raise store.CheckpointError(f"{where}: {model} {flavor} cannot be exported: {str(e).splitlines()[0]}") from None
    check_matches_model(state_dict, spec.model_cls, args)
    output = hf_output.check_output(output, where)
    tmp = hf_output.make_temp(output, origin or {})
    try:
        save_safetensors(spec.hf_adapter.to_hf(state_dict, args), tmp, dtype=dtype)
        return publish_hf_folder(tmp, output, spec, args, dtype, where)
    except BaseException:
        hf_output.discard(tmp)
        raise


def publish_hf_folder(tmp: Path, output: Path, spec, args, dtype: torch.dtype, where: str = "--output") -> Path:
    """Write `config.json` into the finished `tmp` folder and move it to `output` in one rename
    (replacing only an earlier export of ours)."""
    config = spec.hf_adapter.hf_config(args)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return hf_output.publish(tmp, output, where)


def hf_architectures(adapter) -> tuple[str, ...]:
    """The HF architectures an adapter reads: `HF_ARCHITECTURES` (one plait model, several HF
    classes, e.g. Qwen3 and Qwen3-MoE) or its one `HF_ARCHITECTURE`; () when it names none."""
    if hasattr(adapter, "HF_ARCHITECTURES"):
        return tuple(adapter.HF_ARCHITECTURES)
    return (adapter.HF_ARCHITECTURE,) if hasattr(adapter, "HF_ARCHITECTURE") else ()


def _matching_model(config: dict) -> str | None:
    """The plait model whose adapter writes `config`'s architecture."""
    from plait.models import get_model_spec, list_models

    architecture = (config.get("architectures") or [None])[0]
    for name in list_models():
        if architecture in hf_architectures(get_model_spec(name).hf_adapter):
            return name
    return None


def check_hf_folder(path: str | Path, model: str, flavor: str, model_args=None):
    """Read only `config.json` and check it is `model` `flavor`; return (spec, args, config).
    Validation calls this before the model is built, so a wrong model.name or flavor is one line."""
    path = Path(path)
    spec, args = spec_and_args(model, flavor, model_args)
    where = f"checkpoint.initial_load_path = {str(path)!r}"
    config_file = path / "config.json"
    if not config_file.is_file():
        raise store.CheckpointError(f"{where} has no config.json: not a Hugging Face folder")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise store.CheckpointError(f"{where}: config.json is not valid JSON ({e})") from None
    architecture = (config.get("architectures") or [config.get("model_type")])[0]
    if hf_architectures(spec.hf_adapter) and architecture not in hf_architectures(spec.hf_adapter):
        other = _matching_model(config)
        fix = (f"set model.name = {other} (and model.flavor to its size)" if other
               else "plait has no model for it")
        raise store.CheckpointError(f"{where} holds a {architecture} model, not {model}: {fix}")
    try:
        hf_args = spec.hf_adapter.args_from_hf_config(config)
    except (KeyError, ValueError) as e:
        raise store.CheckpointError(f"{where}: its config.json cannot be read as {model} ({e})") from None
    # max_seq_len only sizes the RoPE tables; the run chooses how many multi-token-prediction depths
    # it trains (the folder's are loaded up to them; more than it holds fails as missing tensors),
    # their loss weight, and how it balances its experts. Every other size must be the flavor's.
    chosen = ("max_seq_len", "depth_init", "mtp_layers", "mtp_loss_scale", "aux_loss_coeff", "load_balance_coeff")

    def same(a):
        return dataclasses.replace(hf_args, **{f: getattr(a, f) for f in chosen if hasattr(a, f)}) == a

    if not same(args):
        match = next((name for name, a in spec.flavors.items() if same(a)), None)
        fix = f"set model.flavor = {match}" if match else "set model.flavor (or the model.* sizes) to match it"
        differ = [f.name for f in dataclasses.fields(args)
                  if f.name not in chosen and getattr(hf_args, f.name) != getattr(args, f.name)]
        raise store.CheckpointError(f"{where} is not {model} {flavor} (differs in {', '.join(differ[:6])}): {fix}")
    return spec, args, config


def read_hf_state(path: str | Path, model: str, flavor: str, model_args=None) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights as a plait state dict for `model` `flavor` (full tensors).
    Block-FP8 weights (DeepSeek-V3's release) are dequantised to float32."""
    from plait.models.hf.convert import check_matches_model
    from plait.models.hf.fp8 import dequantize_if_fp8
    from plait.models.hf.io import load_safetensors

    spec, args, config = check_hf_folder(path, model, flavor, model_args)
    from plait.models.hf.checks import check_hf_state

    try:
        hf_state_dict = load_safetensors(path)
        check_hf_state(hf_state_dict, path)
        state_dict = spec.hf_adapter.from_hf(dequantize_if_fp8(hf_state_dict, config), args)
        check_matches_model(state_dict, spec.model_cls, args)
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise store.CheckpointError(f"checkpoint.initial_load_path = {str(path)!r}: {str(e).splitlines()[0]}") from None
    return state_dict
