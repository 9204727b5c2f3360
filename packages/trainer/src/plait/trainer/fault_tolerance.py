"""plait-train as one replica group of several ([fault_tolerance], plait-faulttolerance over torchft).

Each group is its own plait-train job with its own layout inside; the data-parallel replicate axis
runs across groups through torchft. Per step: a quorum (a group behind the quorum takes the live
model, optimizer, schedule and data position of a peer, no checkpoint read), the batch, forward and
backward, the gradient average across the quorum's groups, clipping, and an optimizer step only
where every rank of every group in the quorum committed. A step that lost a group is committed
nowhere: its batch is skipped by every group and the step runs again on the next one.

Each group writes under <dump_folder>/replica_<id> (config.build_config: its own lock, metrics,
exit status); the first group of the quorum writes checkpoints, into its own folder, so no two
groups write one folder. After a restart of the whole job every group resumes its own newest checkpoint and the
quorum hands the newest state to the others.
"""

import os

from .config import Config, ConfigError
from .log import log


def package_config(config: Config):
    """plait-faulttolerance's settings for this run (raises ConfigError with the pip line when it
    is not installed)."""
    try:
        from plait.faulttolerance import FaultToleranceConfig
    except ImportError:
        raise ConfigError("fault_tolerance.enable needs plait-faulttolerance (torchft): "
                          "pip install 'plait-trainer[faulttolerance]'.") from None
    ft = config.fault_tolerance
    return FaultToleranceConfig(
        replica_id=ft.replica_id, group_size=ft.group_size, lighthouse=ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
        min_replicas=ft.min_replicas, quorum_timeout_s=ft.quorum_timeout_s, timeout_s=ft.quorum_timeout_s,
        connect_timeout_s=ft.quorum_timeout_s, semi_sync=None if ft.semi_sync == "none" else ft.semi_sync,
        sync_steps=ft.sync_steps,
        # Every group starts from the same seeded weights: under semi-sync the groups' first local
        # steps are kept instead of replaced by the first group's state at step 0.
        init_sync=ft.semi_sync == "none",
    )  # fmt: skip


def check_fault_tolerance(config: Config, dims) -> None:
    """Refuse, before anything starts, what cannot run as a replica group."""
    ft = config.fault_tolerance
    if not ft.enable:
        return
    if dims.dp_replicate > 1:
        raise ConfigError(f"parallelism.dp_replicate = {dims.dp_replicate} with fault_tolerance.enable: the replicate "
                          "axis runs across the replica groups (fault_tolerance.group_size); set dp_replicate = 1 "
                          "and shard inside each group (dp_shard).")
    package_config(config).validate()


def data_shard(config: Config, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(index, count) of the part of each global batch this rank reads: the groups' parts outermost,
    so a lost group's part is skipped, never read by another group."""
    ft = config.fault_tolerance
    if not ft.enable:
        return dp_rank, dp_degree
    return ft.replica_id * dp_degree + dp_rank, ft.group_size * dp_degree


class ReplicaGroupRun:
    """The trainer's replica group: the live state it serves and takes, the quorum before each step,
    and which group saves. `trainer`: the Trainer (its model, optimizer, scheduler, loader, step)."""

    def __init__(self, config: Config, trainer, rank: int, world_size: int):
        from plait.faulttolerance import ReplicaGroup

        self.trainer = trainer
        self.joined_at: int | None = None  # the step whose state this group took from a peer
        store = {}
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            # One rank without a launcher: the group's manager meets at a store of its own.
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
            store = {"store_addr": "127.0.0.1", "store_port": self._store.port}
        self.group = ReplicaGroup(package_config(config), self._state_dict, self._load_state_dict, rank=rank,
                                  world_size=world_size, device=trainer.device.type, **store)
        # A checkpoint this group resumed from sets the step the quorum compares.
        self.group.load_state_dict({"step": trainer.step, "batches_committed": trainer.step})
        self.participants = 0

    def _state_dict(self) -> dict:
        from plait.checkpoint import state

        from .checkpoint.train_state import train_state

        t = self.trainer
        # Before the first step the optimizer has no state to hand over, and asking for it would
        # make one: torch's state-dict helper initialises it with a zero step that counts as one
        # in Adam's bias correction (the groups' first update then differs from HSDP's).
        if t.optimizer.state:
            live = state.full_state(t.pm.inner, t.optimizer)
        else:
            live = {state.MODEL: state.model_state(t.pm.inner)}
        live[state.TRAIN_STATE] = train_state(t.step, t.scheduler, t.loader, t.config)
        return live

    def _load_state_dict(self, live: dict) -> None:
        from plait.checkpoint import state

        from .checkpoint.train_state import load_train_state

        t = self.trainer
        if state.OPTIMIZER in live:
            state.load_full(t.pm.inner, t.optimizer, live)
        else:  # a peer that has not stepped yet (the first quorum): the weights only
            state.load_model(t.pm.inner, live[state.MODEL])
        t.step, _ = load_train_state(live[state.TRAIN_STATE], t.scheduler, t.loader)
        self.joined_at = t.step

    def begin_step(self) -> None:
        """This step's quorum, before its batch is read; a group behind it takes a peer's state."""
        self.joined_at = None
        info = self.group.begin_step()
        self.participants = info.participants
        if self.joined_at is not None:
            log.info(f"fault tolerance: took the live state of step {self.joined_at} from a peer "
                     f"({info.participants} group(s) in the quorum)")

    def should_save_checkpoint(self) -> bool:
        return self.group.should_save_checkpoint()

    def semi_sync(self):
        """The semi-sync wrapper around the loop (local_sgd, diloco), or None."""
        if not self.group.semi_sync:
            return None
        from plait.faulttolerance import semi_sync

        return semi_sync(self.group, self.trainer.pm.inner, self.trainer.optimizer)

    def shutdown(self) -> None:
        self.group.shutdown()
