"""Hugging Face weights into and out of a sharded (FSDP / HSDP / TP) model, a layer at a time.

Import: a tensor the adapter only renames (probed by handing `from_hf` a stand-in object) is read
as this rank's slice alone (`safe_open(...).get_slice`, the slice a DTensor placement gives the
rank: `compute_local_shape_and_global_offset`). The others (rows permuted for RoPE, experts
stacked, FP8 with scales) are read whole, one transformer layer at a time, dequantised, converted
by `from_hf` (it works on any subset holding whole layers) and sliced. Host memory per rank is its
shard plus at most one layer, not the whole model (a 70B model: ~1 GB per layer instead of
140 GB), and no collective is needed.

Export: layers are dealt out to the ranks; for each layer every rank joins the all-gathers of its
parameters (`full_tensor()`), the owner keeps the full tensors, converts them with `to_hf` and
writes them into its own files, `model-0000i-of-0000N.safetensors` of at most 5 GB each
(huggingface_hub's split, numbered over all writers: hf_shards.py; under pipeline parallel each
stage's ranks deal out that stage's layers among themselves); rank 0 writes
`model.safetensors.index.json` (the layout transformers loads) and `config.json`, then publishes
the folder by renaming it. A rank holds at most its share of the model plus one layer.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from . import hf_export, hf_output, hf_shards, store

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def _group(name: str) -> int:
    """Layer index of a parameter (plait or HF name); -1 for the top-level ones."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def _hf_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (index file, or every *.safetensors)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise store.CheckpointError(f"checkpoint.initial_load_path = {str(path)!r} has no *.safetensors files")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def _read(names: list[str], files: dict[str, Path], path: Path) -> dict[str, torch.Tensor]:
    """Whole tensors, each checked (dtype, FP8 with its scale, finite) where it was read."""
    from safetensors import safe_open

    from plait.models.hf.checks import check_dtype, check_finite

    out = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, keys in by_file.items():
        with _naming(path, keys[0], file), safe_open(str(file), framework="pt") as f:
            for k in keys:
                with _naming(path, k, file):
                    out[k] = f.get_tensor(k)
                    check_dtype(k, out[k], file.name, has_scale=k + "_scale_inv" in files)
                    check_finite(k, out[k], file.name)
    return out


@contextlib.contextmanager
def _naming(path: Path, hf_name: str, file: Path):
    """A file the index names but that is missing, or lacks the tensor, or a tensor that fails
    its checks: one line naming the tensor and the file instead of a SafetensorError trace."""
    from safetensors import SafetensorError

    from plait.models.hf.checks import ImportCheckError

    where = f"checkpoint.initial_load_path = {str(path)!r}"
    try:
        yield
    except ImportCheckError as e:
        raise store.CheckpointError(f"{where}: {e}") from None
    except FileNotFoundError:
        raise store.CheckpointError(f"{where}: {hf_name} is in {file.name}, which does not exist") from None
    except SafetensorError as e:
        raise store.CheckpointError(f"{where}: cannot read {hf_name} from {file.name} ({e})") from None


class _Probe:
    """Stands in for an HF tensor: an adapter that only renames it hands it back unchanged."""


def _renamed_to(adapter, args, hf_name: str, files: dict[str, Path]) -> list[str] | None:
    """The plait names `hf_name` becomes by a rename alone, or None when the adapter transforms it
    (or needs other tensors with it, or it is FP8-scaled)."""
    if hf_name.endswith("_scale_inv") or hf_name + "_scale_inv" in files:
        return None
    probe = _Probe()
    try:
        out = adapter.from_hf({hf_name: probe}, args)
    except Exception:  # the adapter touched it as a tensor, or wants its companions
        return None
    targets = [name for name, value in out.items() if value is probe]
    return targets if targets and len(targets) == len(out) else None


def _local_index(shape: torch.Size, target: torch.Tensor) -> tuple[slice, ...]:
    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def _copy_slice(local: dict, name: str, hf_name: str, file: Path, path: Path) -> None:
    """Read only this rank's part of `hf_name` (safetensors slices) into parameter `name`."""
    from safetensors import safe_open

    from plait.models.hf.checks import check_dtype, check_finite

    target = local.get(name)
    with _naming(path, hf_name, file), safe_open(str(file), framework="pt") as f:
        piece = f.get_slice(hf_name)
        shape = torch.Size(piece.get_shape())
        if target is None or shape != target.shape:
            raise store.CheckpointError(
                f"checkpoint.initial_load_path = {str(path)!r}: {hf_name} in {file.name} (shape {tuple(shape)}) "
                f"does not fit {name} ({'not in the model' if target is None else tuple(target.shape)})")
        part = piece[_local_index(shape, target)]
        # Only a rename: an FP8 tensor here has no scale beside it.
        check_dtype(hf_name, part, file.name, has_scale=False)
        check_finite(hf_name, part, file.name)
        shard = target.to_local() if isinstance(target, DTensor) else target
        shard.copy_(part)


_EXPECTED_SHAPES: dict = {}
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _expected_hf_shapes(spec, args) -> dict[str, tuple]:
    """The HF name -> shape the adapter writes for this model: what a folder must hold (traced on
    the meta device, so free)."""
    key = (spec.model_cls, repr(args))
    if key not in _EXPECTED_SHAPES:
        with torch.device("meta"):
            model = spec.model_cls(args)
        _EXPECTED_SHAPES[key] = {k: tuple(v.shape) for k, v in spec.hf_adapter.to_hf(model.state_dict(), args).items()}
    return _EXPECTED_SHAPES[key]


def _check_hf_shapes(tensors: dict[str, torch.Tensor], files: dict[str, Path], path: Path, spec, args) -> None:
    """Whole tensors the adapter transforms (RoPE rows permuted, experts stacked) in the shape the
    model's HF layout has: one line naming the tensor and its file, not the transform's traceback."""
    expected = _expected_hf_shapes(spec, args)
    for name, tensor in tensors.items():
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != want and tensor.dtype not in _FP8:
            raise store.CheckpointError(
                f"checkpoint.initial_load_path = {str(path)!r}: {name} in {files[name].name} (shape "
                f"{tuple(tensor.shape)}) does not fit the model, which has {want} there"
            )


def local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of `full` that `target` (a DTensor's local shard, or a plain tensor) holds."""
    return full[_local_index(full.shape, target)]


@torch.no_grad()
def load_hf_sharded(model: torch.nn.Module, path: str | Path, model_name: str, flavor: str, model_args=None) -> None:
    """Fill `model` (sharded or not, materialised) from the HF folder `path`, a layer at a time."""
    from plait.models.hf.fp8 import dequantize_if_fp8

    path = Path(path)
    spec, args, config = hf_export.check_hf_folder(path, model_name, flavor, model_args)
    local = get_model_state_dict(model)  # the live parameters and buffers (DTensor shards)
    files = _hf_files(path)
    groups: dict[int, list[str]] = {}
    for name in files:
        groups.setdefault(_group(name), []).append(name)
    filled = set()
    # Layers past the model's depth are DeepSeek's multi-token-prediction module (its config counts
    # them: num_nextn_predict_layers); any other is a file that config.json does not describe.
    depth = getattr(args, "n_layers", None)
    if depth is not None:
        extra = int(config.get("num_nextn_predict_layers", 0) or 0)
        stray = [layer for layer in groups if layer >= depth + extra and layer >= 0]
        if stray:
            raise store.CheckpointError(
                f"checkpoint.initial_load_path = {str(path)!r} holds tensors of layer {min(stray)}"
                f"{f'-{max(stray)}' if len(stray) > 1 else ''}, past its config.json's num_hidden_layers = "
                f"{config.get('num_hidden_layers')} ({extra} multi-token-prediction layers): its files and config.json "
                "disagree (a folder of another model, or a truncated config)"
            )
    for layer in sorted(groups):
        if layer >= getattr(args, "n_layers", float("inf")) + getattr(args, "mtp_layers", 0):
            continue  # DeepSeek's multi-token-prediction layers past the depths this run trains
        # Tensors the adapter only renames are read as this rank's slices alone; the others
        # (permuted rows, stacked experts, FP8) whole, one layer at a time.
        renamed = {n: _renamed_to(spec.hf_adapter, args, n, files) for n in groups[layer]}
        for hf_name, targets in renamed.items():
            for name in targets or ():
                _copy_slice(local, name, hf_name, files[hf_name], path)
                filled.add(name)
        rest = [n for n, targets in renamed.items() if not targets]
        if not rest:
            continue
        whole = _read(rest, files, path)
        _check_hf_shapes(whole, files, path, spec, args)
        try:
            converted = spec.hf_adapter.from_hf(dequantize_if_fp8(whole, config), args)
        except (KeyError, ValueError) as e:
            raise store.CheckpointError(f"checkpoint.initial_load_path = {str(path)!r}: {str(e).splitlines()[0]}") from None
        for name, full in converted.items():
            target = local.get(name)
            if target is None:
                raise store.CheckpointError(f"checkpoint.initial_load_path = {str(path)!r}: {name} is not a "
                                            f"parameter of {model_name} {flavor}")
            if tuple(full.shape) != tuple(target.shape):
                raise store.CheckpointError(f"checkpoint.initial_load_path = {str(path)!r}: {name} has shape "
                                            f"{tuple(full.shape)}, the model {tuple(target.shape)}")
            shard = target.to_local() if isinstance(target, DTensor) else target
            shard.copy_(local_slice(full, target))
            filled.add(name)
        del converted
    missing = sorted(set(local) - filled)
    if missing:
        raise store.CheckpointError(f"checkpoint.initial_load_path = {str(path)!r} lacks {len(missing)} tensors of "
                                    f"{model_name} {flavor}, e.g. {missing[0]}")


_WHERE = "checkpoint.last_save_in_hf"


def export_hf_sharded(model: torch.nn.Module, output: str | Path, model_name: str, flavor: str, dtype: torch.dtype,
                      model_args=None, max_shard_size: int | str = hf_shards.MAX_SHARD_SIZE) -> Path:
    """Write `model` as a Hugging Face folder from all ranks (collective: every rank calls it);
    each writer's files hold at most `max_shard_size` bytes, a larger tensor alone (hf_shards.py)."""
    spec, args = hf_export.spec_and_args(model_name, flavor, model_args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tmp = _start(output, model_name, flavor, rank)
    mine, position = _convert_share(model, spec, args, dtype, rank, world)
    parts = _write_share(mine, tmp, position, rank, max_shard_size)
    _finish(parts, tmp, Path(output), spec, args, dtype, rank)
    return Path(output)


def _start(output: str | Path, model_name: str, flavor: str, rank: int) -> Path:
    """The marked temporary folder the export is written into. Rank 0 checks the output (a new or
    empty folder, or an earlier export: hf_output.py) and makes it; every rank learns its name, or
    the same one-line error."""
    verdict = None
    if rank == 0:
        try:
            out = hf_output.check_output(output, _WHERE)
            verdict = ("ok", str(hf_output.make_temp(out, {"model": model_name, "flavor": flavor})))
        except (store.CheckpointError, OSError) as e:
            verdict = ("error", f"{_WHERE}: cannot write {output}: {e}")
    verdict = _from_rank0(verdict)
    _raise(verdict)
    return Path(verdict[1])


def _convert_share(model: torch.nn.Module, spec, args, dtype: torch.dtype, rank: int,
                   world: int) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's share of the layers as HF tensors (on the CPU, in `dtype`) and its position
    among all writers. Layers are dealt out to the peers (ranks holding the same parameters);
    every peer joins each layer's all-gathers (`full_tensor()`), only the layer's owner keeps it."""
    local = get_model_state_dict(model)
    groups: dict[int, list[str]] = {}
    for name in local:
        groups.setdefault(_group(name), []).append(name)
    order = sorted(groups)
    peer, peers, first_writer = hf_shards.writers(local, len(order), rank, world)
    mine: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(order):
        owner = i % min(peers, len(order))
        full = {}
        for name in groups[layer]:  # every peer joins each all-gather, in the same order
            t = local[name]
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if peer == owner:
                full[name] = t.detach().to("cpu", dtype)
        if peer == owner:
            hf = spec.hf_adapter.to_hf(full, args)
            mine.update({k: v.contiguous() if v.is_contiguous() else v.contiguous().clone() for k, v in hf.items()})
        del full
    return mine, first_writer + peer


def _write_share(mine: dict[str, torch.Tensor], tmp: Path, position: int, rank: int,
                 max_shard_size: int | str) -> list[tuple[dict[str, str], int, str | None]]:
    """Write this rank's tensors into its files (huggingface_hub's split, our numbering over all
    writers); return every rank's (tensor -> file, bytes, problem). A write that fails on one rank
    (disk full) reaches every rank as one line, and none waits."""
    from plait.models.hf.io import save_file_like_open

    files, total = hf_shards.split(mine, max_shard_size)
    # The writers' file counts number the files in one sequence; the gather also waits for rank 0
    # to have made the folder.
    first, count = hf_shards.file_numbers((position, len(files)), _all_gather((position, len(files))))
    weight_map, problem = {}, None
    try:
        for number, names in enumerate(files, start=first):
            file = hf_shards.file_name(number, count)
            tensors = hf_shards.unshared({n: mine[n] for n in names})
            save_file_like_open(tensors, tmp / file, metadata={"format": "pt"})  # 0644, not 0600
            weight_map.update(dict.fromkeys(names, file))
    except (OSError, RuntimeError) as e:
        problem = f"rank {rank}: {store.cause_of(e)}"
    return _all_gather((weight_map, total, problem))


def _finish(parts: list[tuple[dict[str, str], int, str | None]], tmp: Path, output: Path, spec, args,
            dtype: torch.dtype, rank: int) -> None:
    """Unless a rank's write failed (then the temporary folder is discarded), rank 0 writes the
    index and config.json and publishes the folder; every rank ends with rank 0's verdict."""
    from plait.models.hf.io import INDEX_FILE

    failed = next((problem for _, _, problem in parts if problem), None)
    if failed:
        if rank == 0:
            hf_output.discard(tmp)  # ours (marked): nothing half-written is left
        raise store.CheckpointWriteError(f"{_WHERE}: could not write the Hugging Face export {output}: {failed}; "
                                         "nothing was published")
    verdict = None
    if rank == 0:
        try:
            hf_shards.write_index(tmp, INDEX_FILE, [(weight_map, size) for weight_map, size, _ in parts])
            hf_export.publish_hf_folder(tmp, output, spec, args, dtype, _WHERE)
            verdict = ("ok", "")
        except (store.CheckpointError, OSError) as e:
            hf_output.discard(tmp)
            full_disk = isinstance(e, OSError) and not isinstance(e, store.CheckpointError)
            verdict = ("write" if full_disk else "error", f"{_WHERE}: cannot write {output}: {store.cause_of(e)}")
    _raise(_from_rank0(verdict))


def _from_rank0(verdict):
    """Rank 0's `verdict` on every rank."""
    if dist.is_initialized():
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    return verdict


def _raise(verdict: tuple[str, str]) -> None:
    """A verdict as one line: "write" a failed write (CheckpointWriteError), "error" anything else."""
    if verdict[0] == "write":
        raise store.CheckpointWriteError(verdict[1])
    if verdict[0] == "error":
        raise store.CheckpointError(verdict[1])


def _all_gather(obj) -> list:
    """`obj` from every rank, in rank order ([obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
