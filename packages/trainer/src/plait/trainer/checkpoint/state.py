"""What a checkpoint holds, as DCP state dicts, and how it goes back into the live objects.

    "model"       get_model_state_dict: FQN -> tensor (DTensor shards under FSDP / TP)
    "optimizer"   get_optimizer_state_dict: keyed by parameter FQN, so it reshards like the model
    "train_state" one JSON string: step, LR schedule, data-loader position. The same on every
                  rank, so DCP stores it once; the loader position is global (the batch order does
                  not depend on the dp degree), so it continues under any layout.
    rng-rankR.pt  per-rank RNG states (torch CPU / CUDA, python, numpy), a small file next to the
                  DCP files, restored only under the same layout.

Models are addressed by the FQNs of the plain plait model (`ParallelModel.inner`): activation
checkpointing and per-block compile wrap forwards in place, so the names never change.
"""

import json
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
    set_optimizer_state_dict(model, optimizer, state[OPTIMIZER])


def train_state(step: int, scheduler, loader) -> str:
    return json.dumps({"step": step, "lr_scheduler": scheduler.state_dict(), "dataloader": loader.state_dict()})


def load_train_state(text: str, scheduler, loader) -> int:
    """Restore the schedule and the data position; return the step the checkpoint was taken at."""
    state = json.loads(text)
    scheduler.load_state_dict(state["lr_scheduler"])
    try:
        loader.load_state_dict(state["dataloader"])
    except ValueError as e:  # another seed or dataset than the run was started with
        from plait.trainer.config import ConfigError

        raise ConfigError(f"resuming at step {state['step']}: {e}") from None
    return int(state["step"])


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


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG states if the checkpoint has them; return whether it did."""
    file = rng_file(path, rank)
    if not file.is_file():
        return False
    state = torch.load(file, weights_only=True)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    return True
