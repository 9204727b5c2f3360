"""Read and write state dicts as (sharded) safetensors, in the Hugging Face file layout.

One shard is written as `model.safetensors`; more as `model-00001-of-0000N.safetensors` plus
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}),
which is what `transformers` and the Hub expect.
"""

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers checks this metadata to know the tensors are PyTorch's.
_METADATA = {"format": "pt"}
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _umask() -> int:
    """This process's umask, read without changing it where Linux reports it (os.umask sets it,
    and another thread creating a file meanwhile would get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_file_like_open(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """`safetensors` `save_file`, with the mode `open()` would give (0644 under umask 022): the
    library writes 0600, so other users (a serving job, a colleague) could not read an export. A
    failed write (a full disk) is an OSError, as from `open()`: safetensors raises its own error
    type for it, which callers that handle I/O faults would not catch."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        io = re.search(r"IoError\(Os \{ code: (\d+), kind: \w+, message: \"([^\"]*)\"", str(e))
        if io is None:
            raise
        raise OSError(int(io.group(1)), io.group(2), str(path)) from e
    os.chmod(path, 0o666 & ~_umask())


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"not a size: {size!r} (expected e.g. 5GB, 500MB, 1048576)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])


def _prepare(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, cast to `dtype`, none sharing storage (safetensors forbids it)."""
    prepared, seen_storage = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
        storage = tensor.untyped_storage()
        # A view of a larger or already-written storage gets its own copy.
        if storage.data_ptr() in seen_storage or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        prepared[name] = tensor
    return prepared


def _shard(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy, in order: start a new shard when the next tensor would overflow this one."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
    return shards


def save_safetensors_file(
    state_dict: dict[str, torch.Tensor], path: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write `state_dict` as one `.safetensors` file at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file_like_open(_prepare(state_dict, dtype), path, metadata=_METADATA)
    return path


def save_safetensors(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write `state_dict` into `out_dir` as HF-layout safetensors; return the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _prepare(state_dict, dtype)
    shards = _shard(tensors, parse_size(max_shard_size))
    if len(shards) == 1:
        save_file_like_open(shards[0], out_dir / SINGLE_FILE, metadata=_METADATA)
        return [out_dir / SINGLE_FILE]

    files, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file_like_open(shard, out_dir / file_name, metadata=_METADATA)
        files.append(out_dir / file_name)
        weight_map.update({name: file_name for name in shard})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def load_safetensors(path: str | Path, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a `.safetensors` file, or a directory holding `model.safetensors` or a sharded index."""
    path = Path(path)
    if path.is_file():
        return load_file(path, device=str(device))
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        state_dict = {}
        for file_name in dict.fromkeys(weight_map.values()):  # unique, in order
            state_dict.update(load_file(path / file_name, device=str(device)))
        return state_dict
    if (path / SINGLE_FILE).is_file():
        return load_file(path / SINGLE_FILE, device=str(device))
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
