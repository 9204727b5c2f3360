"""The train state a plait-train checkpoint holds beside the model and optimizer (plait.checkpoint.state):
one JSON string of the step, the LR schedule, the data-loader position and the schedule settings.
The same on every rank, so DCP stores it once; the loader position is global (the batch order does
not depend on the dp degree), so it continues under any layout. Which settings a resumed run
takes from its config over the checkpoint's is the trainer's policy, here.
"""

import dataclasses
import json

import torch

from ..config import ConfigError


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
