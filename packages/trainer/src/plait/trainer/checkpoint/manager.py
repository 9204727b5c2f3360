"""Save, resume, keep: the checkpoint life cycle of one run.

- **Resume**: with `checkpoint.enable`, the most recently published complete checkpoint in the
  folder (or `load_step`'s) is validated on rank 0 (files against the marker, DCP metadata, the
  model's names and shapes) and the verdict broadcast; then every rank checks the CRC-32 of a
  share of its files and the verdicts are gathered, so every rank loads the same one, falls back
  to the one before it together (auto-resume), or fails with the same one-line error. DCP
  reshards model and optimizer into this run's layout; this run's optimizer settings and LR
  schedule then replace the saved ones (printed when they differ).
  Otherwise `initial_load_path` (a checkpoint or a Hugging Face folder) gives the initial weights.
- **Save**: every `interval` steps, at the end and on SIGTERM, into `step-N.tmp-<run id>`; when
  every rank has written and hashed its own files, rank 0 writes the `.complete` marker (with
  the checksums) and renames the folder (see `store`). The trainer saves only finite states. `async_mode = "async"` stages the state into CPU memory and writes it from a thread
  over a dedicated gloo group; rank 0 publishes it when its write finished (DCP's coordinator
  finishes only after every rank's data is written). One save is in flight at a time.
- **Keep**: after each publish, only the `keep_last` most recently published complete checkpoints
  remain; at start, rank 0 deletes temporaries that dead runs left behind.
"""

import os
from pathlib import Path

from plait.checkpoint import hf_export, store
from plait.checkpoint.collect import broadcast
from plait.checkpoint.writer import CheckpointWriter

from ..config import Config
from ..log import log
from .resume import Resume
from .saving import Save


class CheckpointManager(Resume, Save):
    def __init__(self, config: Config, dims, model, optimizer, scheduler, loader, rank: int):
        self.config, self.c = config, config.checkpoint
        self.dims, self.rank = dims, rank
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.folder = Path(config.job.dump_folder) / self.c.folder  # an absolute folder stays as is
        self.saving = self.c.enable or self.c.create_seed_checkpoint
        self.run_id = broadcast(os.urandom(4).hex()) if self.saving else ""
        self.resumed_from: tuple[int, Path] | None = None  # (step, path) this run resumed from
        self.model_args = hf_export.args_record(getattr(model, "args", None))
        # The run holds the folder's lock already (run_lock.py: its dump folder's, or its own).
        self.writer = CheckpointWriter(self.folder, self.run_id, self.c.keep_last,
                                       background=self.c.enable and self.c.async_mode == "async", lock=False)
        if self.saving and rank == 0:
            for path in store.remove_stale_temporaries(self.folder, self.run_id):
                self._log(f"removed {path.name}, the unfinished save of an earlier run")

    def _log(self, message: str) -> None:
        log.info(f"checkpoint: {message}")  # rank 0's

    @property
    def layout(self) -> dict:
        d = self.dims
        return {
            "dp_replicate": d.dp_replicate,
            "dp_shard": d.dp_shard,
            "cp": d.cp,
            "tp": d.tp,
            "ep": d.ep,
            "etp": d.etp,
        }


    @property
    def last_good(self) -> tuple[int, Path] | None:
        """(step, path) of the newest finite state on disk: the writer's, or the one resumed from."""
        return self.writer.last_good

    def last_good_note(self) -> str:
        """Where the run's last finite state is, for the divergence message (rank 0 knows)."""
        if not self.c.enable:
            return "No checkpoint is kept (checkpoint.enable = false)."
        if self.last_good is None:
            return "Nothing non-finite was checkpointed; no checkpoint of this run exists yet."
        step, path = self.last_good
        if self.last_good == self.resumed_from:
            # Resumed from it and diverged before the next save: it is finite, but resuming from it
            # again leads to the same divergence, so the message must not send the user back there.
            earlier = [s for s, p in store.checkpoints(self.folder) if s < step and (p / store.MARKER).is_file()]
            further = (f"resume from an earlier one with --checkpoint.load_step {earlier[-1]} (kept: "
                       f"{', '.join(map(str, earlier))}) and a lower optimizer.lr" if earlier else
                       "no earlier checkpoint is kept (checkpoint.keep_last): start again with a lower optimizer.lr")
            return (
                f"Nothing non-finite was checkpointed, but this run resumed from {path} (step {step}) and diverged "
                f"again before its next checkpoint: that checkpoint is finite but leads to the divergence, so the "
                f"same command would diverge again; {further}."
            )
        return (
            f"Nothing non-finite was checkpointed: the last good checkpoint is {path} (step {step}), which the same "
            "command resumes from (with the optimizer.lr and schedule it is given)."
        )

    def close(self) -> None:
        """At the end of a run: wait for the save in flight and publish it."""
        self.writer.close()
