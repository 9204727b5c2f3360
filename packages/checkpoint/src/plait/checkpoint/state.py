"""What a checkpoint holds, as DCP state dicts, and how it goes back into the live objects.

    "model"       get_model_state_dict: FQN -> tensor (DTensor shards under FSDP / TP)
    "optimizer"   get_optimizer_state_dict: keyed by parameter FQN, so it reshards like the model
    "train_state" one JSON string the caller writes (plait-train: step, LR schedule, data-loader
                  position; the same on every rank, so DCP stores it once).
    rng-rankR.pt  per-rank RNG states (torch CPU / CUDA, python, numpy), a small file next to the
                  DCP files, restored only under the same layout.

Models are addressed by the FQNs of the plain plait model (`ParallelModel.inner`): activation
checkpointing and per-block compile wrap forwards in place, so the names never change.
"""

import random
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

MODEL, OPTIMIZER, TRAIN_STATE = "model", "optimizer", "train_state"


def model_state(model: nn.Module) -> dict:
    return get_model_state_dict(model)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model + optimizer state dicts (sharded; no copies of the model's tensors)."""
    return {MODEL: get_model_state_dict(model), OPTIMIZER: get_optimizer_state_dict(model, optimizer)}


def load_model(model: nn.Module, state: dict) -> None:
    set_model_state_dict(model, state, options=StateDictOptions(strict=True))


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    load_model(model, state[MODEL])
    _own_param_groups(model, optimizer, state[OPTIMIZER])
    set_optimizer_state_dict(model, optimizer, state[OPTIMIZER])


def _own_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state: dict) -> None:
    """Give the loaded param groups this rank's parameter names.

    DCP stores a param group's list of parameter FQNs once (one rank's). Under pipeline parallel
    every rank holds other parameters, so a checkpoint saved under one pp degree names the
    parameters of one stage only; torch matches groups by those names and would leave the other
    stages' groups without their settings. The groups' settings are the same on every rank (one
    group), so the names are this rank's own. A checkpoint whose groups already name exactly this
    rank's parameters (every layout without pp) is left as it is.
    """
    groups = optim_state.get("param_groups", [])
    own = [g["params"] for g in get_optimizer_state_dict(model, optimizer)["param_groups"]]
    if len(groups) != len(own) or all(set(g["params"]) == set(o) for g, o in zip(groups, own)):
        return
    for group, params in zip(groups, own):
        group["params"] = list(params)


def rng_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rng-rank{rank:05d}.pt"


def save_rng(path: Path, rank: int) -> None:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    torch.save(state, rng_file(path, rank))


def reseed(seed: int) -> None:
    """Every generator a checkpoint's RNG file restores, seeded from `seed` instead."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG states if the checkpoint has them; return whether it did."""
    file = rng_file(path, rank)
    if not file.is_file():
        return False
    try:
        state = torch.load(file, weights_only=True)
    except Exception as e:  # an UnpicklingError or a zip error: the file is not what the save wrote
        from .store import CheckpointError

        raise CheckpointError(f"checkpoint {path} is corrupt: {file.name} is unreadable ({type(e).__name__})") from None
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    return True
