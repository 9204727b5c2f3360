"""Save, resume, keep: the checkpoint life cycle of one run.

- **Resume**: with `checkpoint.enable`, the newest complete checkpoint in the folder (or
  `load_step`'s) is validated on rank 0 (files against the marker, DCP metadata, the model's
  names and shapes) and the verdict broadcast, so every rank loads the same one or every rank
  fails with the same one-line error. DCP reshards model and optimizer into this run's layout.
  Otherwise `initial_load_path` (a checkpoint or a Hugging Face folder) gives the initial weights.
- **Save**: every `interval` steps, at the end and on SIGTERM, into `step-N.tmp-<run id>`; when
  every rank has written, rank 0 writes the `.complete` marker and renames the folder (see
  `store`). `async_mode = "async"` stages the state into CPU memory and writes it from a thread
  over a dedicated gloo group; rank 0 publishes it when its write finished (DCP's coordinator
  finishes only after every rank's data is written). One save is in flight at a time.
- **Keep**: after each publish, only the newest `keep_last` complete checkpoints remain; at start,
  rank 0 deletes temporaries that dead runs left behind.
"""

import os
import signal
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..config import Config
from . import hf_export, hf_sharded, state, store
from .store import CheckpointError

# Test hooks (the checkpoint tests' only way to die at an exact point): SIGKILL every rank right
# after the checkpoint of step N is published, or after its files are written but before the marker.
KILL_AFTER_SAVE = "PLAIT_TEST_KILL_AFTER_SAVE"
KILL_DURING_SAVE = "PLAIT_TEST_KILL_DURING_SAVE"


def _test_kill(variable: str, step: int) -> None:
    if os.environ.get(variable) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, config: Config, dims, model, optimizer, scheduler, loader, rank: int):
        self.config, self.c = config, config.checkpoint
        self.dims, self.rank = dims, rank
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.folder = Path(config.job.dump_folder) / self.c.folder  # an absolute folder stays as is
        self.pending = None  # (future, step, temp path, marker meta) of the async save in flight
        self.saving = self.c.enable or self.c.create_seed_checkpoint
        self.run_id = _broadcast(os.urandom(4).hex()) if self.saving else ""
        self.async_group = None
        if self.c.enable and self.c.async_mode == "async" and dist.is_initialized():
            # Collectives of the background writer must not interleave with training's.
            self.async_group = dist.new_group(backend="gloo")
        if self.saving and rank == 0:
            for path in store.remove_stale_temporaries(self.folder, self.run_id):
                self._log(f"removed {path.name}, the unfinished save of an earlier run")

    def _log(self, message: str) -> None:
        if self.rank == 0:
            print(f"plait-train: checkpoint: {message}", flush=True)

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

    # ---- resume -------------------------------------------------------------------------------

    def load(self) -> int:
        """Restore what the configuration asks for; return the last completed step (0: a new run)."""
        # Shapes on every rank before rank 0 decides alone (no rank may enter a collective by itself).
        self._shapes = {name: tuple(t.shape) for name, t in state.model_state(self.model).items()}
        if self.c.enable and not self.c.create_seed_checkpoint:
            path, meta = self._agree(self._choose)
            if path is not None:
                return self._load(Path(path), meta)
        if self.c.initial_load_path:
            self._load_initial()
        return 0

    def _agree(self, decide):
        """Run `decide()` on rank 0 and share its (result, meta) or its CheckpointError with all ranks."""
        verdict = None
        if self.rank == 0:
            try:
                verdict = ("ok", decide())
            except CheckpointError as e:
                verdict = ("error", str(e))
        kind, value = _broadcast(verdict)
        if kind == "error":
            raise CheckpointError(value)
        return value

    def _choose(self) -> tuple[str | None, dict | None]:
        step = self.c.load_step
        if step >= 0:
            path = self.folder / store.step_name(step)
            available = [s for s, _ in store.checkpoints(self.folder)]
            if not path.is_dir():
                raise CheckpointError(
                    f"checkpoint.load_step = {step}: there is no {path} (steps in {self.folder}: "
                    f"{', '.join(map(str, available)) or 'none'}); pick one of those or -1 for the newest"
                )
            try:
                meta = store.check(path)
            except CheckpointError as e:
                raise CheckpointError(
                    f"{e}; checkpoint.load_step = {step} asks for it: pick another step or -1 for the newest complete one"
                ) from None
        else:
            path, meta, warnings = store.newest_complete(self.folder)
            for warning in warnings:
                print(f"plait-train: warning: checkpoint: {warning}", flush=True)
            if path is None:
                return None, None
        self._check_model(path, meta)
        return str(path), meta

    def _check_model(self, path: Path, meta: dict) -> None:
        """The checkpoint must hold this model: same parameter names and global shapes."""
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        saved = {
            key[len("model.") :]: tuple(item.size)
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(item, "size")
        }
        ours = self._shapes
        problems = [f"missing {k}" for k in sorted(ours.keys() - saved.keys())]
        problems += [f"{k}: {saved[k]} != {ours[k]}" for k in sorted(ours.keys() & saved.keys()) if saved[k] != ours[k]]
        if problems:
            what = f"{meta.get('model')} {meta.get('flavor')}"
            raise CheckpointError(
                f"checkpoint {path} holds another model ({what}; {'; '.join(problems[:3])}) than "
                f"{self.config.model.name} {self.config.model.flavor}: set model.flavor to match it or use "
                "another checkpoint.folder"
            )
        if not meta.get("model_only") and state.TRAIN_STATE not in metadata.state_dict_metadata:
            raise CheckpointError(f"checkpoint {path} is corrupt: it has no train_state")

    def _dcp_load(self, sd: dict, path: Path) -> None:
        try:
            with store.single_process_quiet():
                dcp.load(sd, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        except Exception as e:  # DCP wraps per-rank failures; one line is what the user needs
            raise CheckpointError(f"checkpoint {path} could not be loaded: {str(e).strip().splitlines()[0]}") from None

    def _load(self, path: Path, meta: dict) -> int:
        t0 = time.perf_counter()
        if meta.get("model_only"):
            sd = {state.MODEL: state.model_state(self.model)}
            self._dcp_load(sd, path)
            state.load_model(self.model, sd[state.MODEL])
            self._log(f"initial weights from {path} (model only); training starts at step 1")
            return 0
        sd = state.full_state(self.model, self.optimizer)
        sd[state.TRAIN_STATE] = ""
        self._dcp_load(sd, path)
        state.load_full(self.model, self.optimizer, sd)
        step = state.load_train_state(sd[state.TRAIN_STATE], self.scheduler, self.loader)
        same_layout = meta.get("world_size") == self.dims.world_size and meta.get("layout") == self.layout
        rng = same_layout and state.load_rng(path, self.rank)
        how = "same layout" if same_layout else f"resharded from {meta.get('world_size')} ranks {meta.get('layout')}"
        self._log(
            f"resuming from {path} (step {step}, {how}{', RNG restored' if rng else ''}) "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        return step

    def _load_initial(self) -> None:
        path = Path(self.c.initial_load_path)
        if self.c.initial_load_hf:
            # Each rank reads a layer at a time and keeps its own slices (hf_sharded.py).
            hf_sharded.load_hf_sharded(
                self.model, path, self.config.model.name, self.config.model.flavor, getattr(self.model, "args", None)
            )
            self._log(f"initial weights from Hugging Face {path}")
            return

        def decide():
            meta = store.check(path)
            self._check_model(path, dict(meta, model_only=True))
            return str(path), meta

        self._agree(decide)
        sd = {state.MODEL: state.model_state(self.model)}
        self._dcp_load(sd, path)
        state.load_model(self.model, sd[state.MODEL])
        self._log(f"initial weights from {path} (model only); training starts at step 1")

    # ---- save ---------------------------------------------------------------------------------

    def after_step(self, step: int, last: bool = False, stopping: bool = False) -> None:
        """Called on every rank after every step: publish a finished async save, save when due."""
        if self.pending is not None:
            self._poll()
        if not self.c.enable:
            return
        due = last or stopping or (self.c.interval > 0 and step % self.c.interval == 0)
        if due:
            final = last or stopping
            self._save(step, model_only=False, background=self.c.async_mode == "async" and not final)
            if last and self.c.last_save_in_hf:
                self._export_hf(step)

    def save_seed(self) -> Path:
        """`create_seed_checkpoint`: the freshly initialised model, alone, as step 0."""
        self._save(0, model_only=True, background=False)
        return self.folder / store.step_name(0)

    def _meta(self, step: int, model_only: bool) -> dict:
        c = self.config
        return {
            "step": step,
            "model_only": model_only,
            "world_size": self.dims.world_size,
            "layout": self.layout,
            "model": c.model.name,
            "flavor": c.model.flavor,
            "dtype": c.training.dtype,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "format": 1,
        }

    def _save(self, step: int, model_only: bool, background: bool) -> None:
        self._wait()
        t0 = time.perf_counter()
        tmp = store.temp_path(self.folder, step, self.run_id)
        tmp.mkdir(parents=True, exist_ok=True)
        if model_only:
            sd = {state.MODEL: state.model_state(self.model)}
        else:
            sd = state.full_state(self.model, self.optimizer)
            sd[state.TRAIN_STATE] = state.train_state(step, self.scheduler, self.loader)
            state.save_rng(tmp, self.rank)
        meta = self._meta(step, model_only)
        if background:
            with store.single_process_quiet():
                future = dcp.async_save(
                    sd, checkpoint_id=str(tmp), process_group=self.async_group, no_dist=not dist.is_initialized()
                )
            self.pending = (future, step, tmp, meta)
            self._log(f"step {step} staged in {time.perf_counter() - t0:.2f} s, writing in the background")
            return
        with store.single_process_quiet():
            dcp.save(sd, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        _test_kill(KILL_DURING_SAVE, step)
        _barrier()  # every rank's files are written
        if self.rank == 0:
            self._publish(step, tmp, meta, f"{time.perf_counter() - t0:.2f} s")
        if os.environ.get(KILL_AFTER_SAVE) == str(step):
            _barrier()  # published before anyone dies
            _test_kill(KILL_AFTER_SAVE, step)

    def _publish(self, step: int, tmp: Path, meta: dict, how: str) -> None:
        """Rank 0: marker, atomic rename, pruning."""
        store.write_marker(tmp, meta)
        final = self.folder / store.step_name(step)
        store.publish(tmp, final)
        removed = store.prune(self.folder, self.c.keep_last)
        pruned = f", removed {', '.join(p.name for p in removed)}" if removed else ""
        self._log(f"saved {final} ({how}){pruned}")

    def _poll(self) -> None:
        future, step, tmp, meta = self.pending
        if future.done():
            self._finish(future, step, tmp, meta)

    def _wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, published)."""
        if self.pending is not None:
            t0 = time.perf_counter()
            self.pending[0].result()
            self._finish(*self.pending, waited=time.perf_counter() - t0)

    def _finish(self, future, step: int, tmp: Path, meta: dict, waited: float = 0.0) -> None:
        self.pending = None
        try:
            future.result()
        except Exception as e:
            raise CheckpointError(f"the background save of step {step} to {tmp} failed: {e}") from e
        if self.rank == 0:
            self._publish(step, tmp, meta, f"written in the background, waited {waited:.2f} s")

    def _export_hf(self, step: int) -> None:
        # Every rank writes its share of the layers (hf_sharded.py); rank 0 the index and config.
        out = hf_sharded.export_hf_sharded(
            self.model, self.folder / f"hf-{store.step_name(step)}", self.config.model.name,
            self.config.model.flavor, hf_export.DTYPES[self.c.export_dtype],
            getattr(self.model, "args", None),  # the flavor with this run's [model] overrides
        )
        self._log(f"exported {out} ({self.c.export_dtype}, Hugging Face safetensors)")

    def close(self) -> None:
        """At the end of a run: wait for the save in flight and publish it."""
        self._wait()
        _barrier()
