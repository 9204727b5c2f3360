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

import dataclasses
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


def schedule_settings(config) -> dict:
    """The settings that shape the learning rate from here on, as `--section.key` names."""
    o, s = config.optimizer, config.lr_scheduler
    return {
        "optimizer.lr": o.lr,
        "optimizer.betas": list(o.betas),
        "optimizer.eps": o.eps,
        "optimizer.weight_decay": o.weight_decay,
        "training.steps": config.training.steps,
        **{f"lr_scheduler.{k}": v for k, v in dataclasses.asdict(s).items()},
    }


def train_state(step: int, scheduler, loader, config) -> str:
    return json.dumps({
        "step": step, "lr_scheduler": scheduler.state_dict(), "dataloader": loader.state_dict(),
        "settings": schedule_settings(config),
    })  # fmt: skip


def load_train_state(text: str, scheduler, loader) -> tuple[int, dict]:
    """Restore the schedule and the data position; return the step the checkpoint was taken at and
    the schedule settings it was saved with ({} for checkpoints that predate them)."""
    state = json.loads(text)
    scheduler.load_state_dict(state["lr_scheduler"])
    try:
        loader.load_state_dict(state["dataloader"])
    except ValueError as e:  # another seed or dataset than the run was started with
        from plait.trainer.config import ConfigError

        raise ConfigError(f"resuming at step {state['step']}: {e}") from None
    return int(state["step"]), state.get("settings", {})


def apply_configured_schedule(optimizer: torch.optim.Optimizer, scheduler, config, saved: dict) -> list[str]:
    """After loading: this run's optimizer hyper-parameters and LR schedule replace the saved ones
    (the optimizer state dict restores the saved lr, betas, eps, weight decay), and the schedule
    continues from the loaded step. Returns "key old -> new" for every setting that changed.

    The schedule is a function of (step, training.steps, [lr_scheduler]) that LambdaLR evaluates
    with this run's config, so a raised training.steps continues the new schedule at the loaded
    step (the decay stretches over the new length) instead of the old schedule's end (lr 0).
    """
    group0 = optimizer.param_groups[0]
    before = {
        "optimizer.lr": group0.get("initial_lr", scheduler.base_lrs[0]),
        "optimizer.betas": list(group0["betas"]),
        "optimizer.eps": group0["eps"],
        "optimizer.weight_decay": group0["weight_decay"],
    }
    before = {**saved, **before}  # the optimizer's own values win over the recorded ones
    o = config.optimizer
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler.base_lrs = [o.lr for _ in optimizer.param_groups]
    # What LambdaLR.get_lr computes at the loaded step, with this run's schedule: bitwise the saved
    # lr when nothing changed.
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    now = schedule_settings(config)
    return [f"{key} {before[key]} -> {value}" for key, value in now.items() if key in before and before[key] != value]


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
