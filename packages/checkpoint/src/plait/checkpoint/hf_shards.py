"""Which rank writes which files of a sharded Hugging Face export, and the index that maps them.

The ranks holding the same parameters (peers: every rank, or one pipeline stage's) deal their
layers out to min(peers, layers) writers (`writers`). Each writer cuts the tensors it converted
into files of at most `max_shard_size` bytes with huggingface_hub's splitter (`split`: in order,
a new file when the next tensor would overflow this one, a larger tensor alone in its file: the
grouping `save_pretrained` writes). What stays ours is what the splitter cannot know, as no rank
sees the others' tensors: one numbering over every writer's files (`file_numbers`),
`model-0000i-of-0000N.safetensors` in writer order, and `model.safetensors.index.json` assembled
on rank 0 from every writer's part (`write_index`; written for a single file too, so a folder's
layout does not depend on the number of ranks).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

# The size transformers' save_pretrained and huggingface_hub's splitter cap a file at.
MAX_SHARD_SIZE = "5GB"


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes safetensors writes for `tensor` (its elements, not the storage it is a view of)."""
    return tensor.numel() * tensor.element_size()


def split(tensors: dict[str, torch.Tensor], max_shard_size: int | str = MAX_SHARD_SIZE) -> tuple[list[list[str]], int]:
    """(the names each file holds, in order; their total bytes): huggingface_hub's grouping.

    Sized by the bytes written, with no storage sharing (the writer gives a tied tensor in the same
    file its own copy: `unshared`), so the split of real tensors is that of their shapes and dtypes."""
    from huggingface_hub import split_state_dict_into_shards_factory

    plan = split_state_dict_into_shards_factory(
        tensors, get_storage_size=_nbytes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size,
    )
    return list(plan.filename_to_tensors.values()), plan.metadata["total_size"]


def writers(local: dict, n_groups: int, rank: int, world: int) -> tuple[int, int, int]:
    """(this rank's index among its peers, the peers, the position of its peers' first writer
    among all writers). Peers are the ranks holding the same parameters: every rank without
    pipeline parallel, one pp stage's ranks with it (their DTensors' collectives span just them).
    Each peer set deals its layers out to min(peers, layers) writers."""
    if not dist.is_initialized():
        return 0, 1, 0
    names = hashlib.sha256("\n".join(sorted(local)).encode()).hexdigest()  # not the names: 512 ranks gather it
    keys = [None] * world
    dist.all_gather_object(keys, (names, n_groups))
    sets = list(dict.fromkeys(keys))  # in order of their first rank
    per_set = [min(keys.count(key), key[1]) for key in sets]
    return keys[:rank].count(keys[rank]), keys.count(keys[rank]), sum(per_set[:sets.index(keys[rank])])


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (a tied head): give repeats their own copy."""
    seen, out = set(), {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def file_name(number: int, files: int) -> str:
    """The name of file `number` (from 1) of `files`, as transformers and the Hub expect it."""
    return f"model-{number:05d}-of-{files:05d}.safetensors"


def file_numbers(mine: tuple[int, int], everyone: list[tuple[int, int]]) -> tuple[int, int]:
    """(the number of this writer's first file, the files of all writers) from every rank's
    (position among the writers, files it writes); a rank writing nothing has 0 files."""
    position, _ = mine
    first = 1 + sum(count for pos, count in everyone if pos < position)
    return first, sum(count for _, count in everyone)


def write_index(folder: Path, index_file: str, parts: list[tuple[dict[str, str], int]]) -> None:
    """`index_file` in `folder` from every writer's (tensor -> file, total bytes)."""
    weight_map = {name: file for names, _ in parts for name, file in names.items()}
    total = sum(size for _, size in parts)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / index_file).write_text(json.dumps(index, indent=2) + "\n")
