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
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from plait.checkpoint import hf_export, hf_output, hf_sharded, state, store
from plait.checkpoint.store import CheckpointError

from ..config import Config
from . import train_state

# Test hooks (the checkpoint tests' only way to die at an exact point): SIGKILL every rank right
# after the checkpoint of step N is published, or after its files are written but before the marker.
KILL_AFTER_SAVE = "PLAIT_TEST_KILL_AFTER_SAVE"
KILL_DURING_SAVE = "PLAIT_TEST_KILL_DURING_SAVE"
# Test hook: every synchronous full save first sleeps this many seconds (a large model's save),
# to show that the launcher's grace on SIGTERM (job.stop_grace_s) must cover the final save.
SLOW_SAVE = "PLAIT_TEST_SLOW_SAVE_S"


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


def _all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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
        self.writer = None  # the thread that hashes an async save's files once DCP wrote them
        self.last_good: tuple[int, Path] | None = None  # (step, path) of the newest finite state on disk
        self.resumed_from: tuple[int, Path] | None = None  # (step, path) this run resumed from
        self._rejected: set[str] = set()  # rank 0: checkpoints found damaged while choosing
        self.model_args = hf_export.args_record(getattr(model, "args", None))
        self.control_group = None
        if self.c.enable and self.c.async_mode == "async" and dist.is_initialized():
            # Collectives of the background writer must not interleave with training's.
            self.async_group = dist.new_group(backend="gloo")
            # The ranks agree on the CPU (no device sync) when a background save is finished on all
            # of them and whether it failed anywhere, so all learn of a failure at the same step.
            self.control_group = dist.new_group(backend="gloo")
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
        if self.c.enable and self.c.last_save_in_hf and not self.c.create_seed_checkpoint:
            # Before step 1, not after the whole run: the export's folder must be ours to write.
            output = self._hf_output(self.config.training.steps)
            self._agree(lambda: str(hf_output.check_output(output, "checkpoint.last_save_in_hf")))
        if self.c.enable and not self.c.create_seed_checkpoint:
            path, meta = self._choose_verified()
            if path is not None:
                return self._load(Path(path), meta)
            self._agree(self._fresh_start_allowed)
        if self.c.initial_load_path:
            self._load_initial()
        return 0

    def _fresh_start_allowed(self) -> None:
        """Rank 0: nothing can be resumed. Over a folder that holds checkpoints that is an error
        unless checkpoint.allow_fresh_start; then the old metrics are kept under another name."""
        found = [path.name for _, path in store.checkpoints(self.folder)]
        if not found:
            return
        if not self.c.allow_fresh_start:
            raise CheckpointError(
                f"checkpoint.folder {self.folder} holds {len(found)} checkpoints ({', '.join(found[-3:])}) and none "
                "can be resumed (see the warnings above): repair or move them, or pass "
                "--checkpoint.allow_fresh_start true to train from step 1 (they are kept)"
            )
        metrics = Path(self.config.job.dump_folder) / "metrics.jsonl"
        if metrics.is_file():
            kept = metrics.with_name(f"metrics.jsonl.replaced-{self.run_id}")
            os.replace(metrics, kept)
            self._log(f"training from step 1 (checkpoint.allow_fresh_start); the earlier metrics are in {kept.name}")

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

    def _choose_verified(self) -> tuple[str | None, dict | None]:
        """Rank 0 chooses, every rank verifies a share of the checksums; auto-resume falls back to
        the checkpoint published before a damaged one, an explicit load_step fails."""
        while True:
            path, meta = self._agree(self._choose)
            if path is None:
                return None, None
            problem, rng_problem = self._verify(Path(path), meta)
            if problem is None:
                if rng_problem:
                    meta = dict(meta, **{store.RNG_PROBLEM: meta.get(store.RNG_PROBLEM) or rng_problem})
                return path, meta
            if self.c.load_step >= 0:
                raise CheckpointError(
                    f"{problem}; checkpoint.load_step = {self.c.load_step} asks for it: pick another step or -1 "
                    "for the newest good one"
                )
            if self.rank == 0:
                print(f"plait-train: warning: checkpoint: skipping {problem}", flush=True)
                self._rejected.add(path)

    def _verify(self, path: Path, meta: dict) -> tuple[str | None, str | None]:
        """Every rank hashes every world_size-th recorded file; the first problem any rank found
        in the model / optimizer files, and the first in the RNG files (which alone do not reject
        a checkpoint: it resumes re-seeded)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        names = sorted(meta.get("checksums") or {})[self.rank :: world]
        rng_names = [n for n in names if store.is_rng_file(n)]
        rng_names = [n for n in rng_names if (Path(path) / n).is_file()]  # a missing one: check() noted it
        problem = store.verify_checksums(path, meta, [n for n in names if not store.is_rng_file(n)])
        rng_problem = store.verify_checksums(path, meta, rng_names)
        gathered = _all_gather((problem, rng_problem))
        return next((p for p, _ in gathered if p), None), next((r for _, r in gathered if r), None)

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
            path, meta, warnings = store.newest_complete(self.folder, skip=self._rejected)
            for warning in warnings:
                print(f"plait-train: warning: checkpoint: {warning}", flush=True)
            if path is None:
                return None, None
        self._check_model_args(path, meta)
        self._check_model(path, meta)
        return str(path), meta

    def _check_model_args(self, path: Path, meta: dict) -> None:
        """Resuming continues the same model: its arguments (the flavor after [model] overrides)
        must be the checkpoint's, not only its shapes (rope_theta, norm_eps change no shape)."""
        saved, ours = meta.get("model_args"), self.model_args
        if not saved or not ours or meta.get("model") != self.config.model.name:
            return  # a checkpoint from before the record; another model fails on its names below
        skip = hf_export.NOT_RECORDED
        differ = [k for k in sorted(saved.keys() | ours.keys()) if k not in skip and saved.get(k) != ours.get(k)]
        if differ:
            shown = ", ".join(f"{k} {saved.get(k)!r} (now {ours.get(k)!r})" for k in differ[:6])
            more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
            raise CheckpointError(
                f"checkpoint {path} was trained with other model arguments ({meta.get('flavor')} flavor): {shown}{more}; "
                f"resume with the checkpoint's ({self._resume_flags(meta, saved, skip)}) or use another checkpoint.folder"
            )

    def _resume_flags(self, meta: dict, saved: dict, skip) -> str:
        """The flags that give back the checkpoint's model: its flavor first when it was another
        (then only what differs from that flavor), every differing argument (vocab_size too)."""
        import dataclasses

        from plait.models import get_model_spec

        flavor, base, flags = meta.get("flavor"), dict(self.model_args), []
        flavors = get_model_spec(self.config.model.name).flavors
        if flavor and flavor != self.config.model.flavor and flavor in flavors:
            flags.append(f"--model.flavor {flavor}")
            base = dataclasses.asdict(flavors[flavor])
        for key in sorted(saved):
            value = saved[key]
            if key in skip or value == base.get(key):
                continue
            if isinstance(value, dict):
                flags.append(f"[model] {key} = {value} in the TOML")
            else:
                flags.append(f"--model.{key} {value}")
        return " ".join(flags)

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
        except (Exception, CheckpointException) as e:  # DCP's derives from BaseException; one line is what the user needs
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
        step, saved_settings = train_state.load_train_state(sd[state.TRAIN_STATE], self.scheduler, self.loader)
        changes = train_state.apply_configured_schedule(self.optimizer, self.scheduler, self.config, saved_settings)
        same_layout = meta.get("world_size") == self.dims.world_size and meta.get("layout") == self.layout
        rng = same_layout and self._load_rng(path, meta, step)
        how = "same layout" if same_layout else f"resharded from {meta.get('world_size')} ranks {meta.get('layout')}"
        self._log(
            f"resuming from {path} (step {step}, {how}{', RNG restored' if rng else ''}) "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        if changes:
            self._log(
                f"this run's settings replace the checkpoint's: {', '.join(changes)}; the schedule continues at "
                f"step {step + 1} with lr {self.scheduler.get_last_lr()[0]:.3g}"
            )
        self.last_good = self.resumed_from = (step, path)
        return step

    def _load_rng(self, path: Path, meta: dict, step: int) -> bool:
        """Restore this rank's RNG states; when any rank's RNG file is damaged, every rank is
        re-seeded from job.seed and the step instead (a warning says so) and the run goes on."""
        problem = meta.get(store.RNG_PROBLEM)
        if problem is None:
            try:
                state.load_rng(path, self.rank)
            except CheckpointError as e:
                problem = str(e)
        problems = [p for p in _all_gather(problem) if p]
        if not problems:
            return True
        state.reseed(self.config.job.seed + step)
        if self.rank == 0:
            print(
                f"plait-train: warning: checkpoint: {problems[0]}: model, optimizer and data position are intact, so "
                f"the run resumes, with every random number generator re-seeded from job.seed + {step} instead of "
                "restored (random draws from here on differ from an uninterrupted run's)",
                flush=True,
            )
        return False

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

        _, meta = self._agree(decide)
        problem, _ = self._verify(path, meta)  # only its model is loaded
        if problem:
            raise CheckpointError(f"{problem}; checkpoint.initial_load_path names it: use another checkpoint")
        sd = {state.MODEL: state.model_state(self.model)}
        self._dcp_load(sd, path)
        state.load_model(self.model, sd[state.MODEL])
        self._log(f"initial weights from {path} (model only); training starts at step 1")

    # ---- save ---------------------------------------------------------------------------------

    def due(self, step: int, last: bool = False, stopping: bool = False) -> bool:
        """Whether `after_step` saves at this step (the trainer checks the state is finite first)."""
        return self.c.enable and (last or stopping or (self.c.interval > 0 and step % self.c.interval == 0))

    def after_step(self, step: int, last: bool = False, stopping: bool = False) -> None:
        """Called on every rank after every step: publish a finished async save, save when due."""
        if self.pending is not None:
            self._poll()
        if self.due(step, last, stopping):
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
            "model_args": self.model_args,  # the flavor after this run's [model] overrides
            "dtype": c.training.dtype,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "format": 1,
        }

    def _save(self, step: int, model_only: bool, background: bool) -> None:
        self._wait()
        t0 = time.perf_counter()
        tmp = store.temp_path(self.folder, step, self.run_id)
        problem = None
        try:  # a write that fails on one rank fails on every rank, with one line (no rank waits alone)
            tmp.mkdir(parents=True, exist_ok=True)
            if not model_only:
                state.save_rng(tmp, self.rank)
        except (OSError, RuntimeError) as e:  # torch.save's zip writer raises RuntimeError on a full disk
            problem = store.cause_of(e)
        self._raise_if_failed(step, tmp, _all_gather(problem))
        if model_only:
            sd = {state.MODEL: state.model_state(self.model)}
        else:
            sd = state.full_state(self.model, self.optimizer)
            sd[state.TRAIN_STATE] = train_state.train_state(step, self.scheduler, self.loader, self.config)
        meta = self._meta(step, model_only)
        if background:
            try:
                with store.single_process_quiet():
                    written = dcp.async_save(
                        sd, checkpoint_id=str(tmp), process_group=self.async_group, no_dist=not dist.is_initialized()
                    )
            except (Exception, CheckpointException) as e:
                self._raise_if_failed(step, tmp, [store.cause_of(e)])
            if self.writer is None:
                self.writer = ThreadPoolExecutor(1, thread_name_prefix="plait-checksums")
            future = self.writer.submit(self._hash_when_written, written, tmp)
            self.pending = (future, step, tmp, meta)
            self._log(f"step {step} staged in {time.perf_counter() - t0:.2f} s, writing in the background")
            return
        if not model_only and os.environ.get(SLOW_SAVE):
            time.sleep(float(os.environ[SLOW_SAVE]))
        try:
            with store.single_process_quiet():
                dcp.save(sd, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure: all are here
            self._raise_if_failed(step, tmp, [store.cause_of(e)])
        _test_kill(KILL_DURING_SAVE, step)
        crcs = self._gather_checksums(tmp, group=None)  # every rank's files are written and hashed
        verdict = None
        if self.rank == 0:
            try:
                self._publish(step, tmp, dict(meta, crcs=crcs), f"{time.perf_counter() - t0:.2f} s")
            except (OSError, CheckpointError) as e:
                verdict = store.cause_of(e)
        self._raise_if_failed(step, tmp, [_broadcast(verdict)])
        if not model_only:  # every rank knows the last good checkpoint (for its error lines)
            self.last_good = (step, self.folder / store.step_name(step))
        if os.environ.get(KILL_AFTER_SAVE) == str(step):
            _barrier()  # published before anyone dies
            _test_kill(KILL_AFTER_SAVE, step)

    def _raise_if_failed(self, step: int, tmp: Path, problems: list) -> None:
        """Every rank: if any rank's part of this save failed, remove it (rank 0) and raise one
        line naming the folder, the cause and the checkpoint a resume would use."""
        problem = next((p for p in problems if p), None)
        if problem is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # this run's own temporary folder: frees the space
        kept = f"{self.last_good[1]} (step {self.last_good[0]})" if self.last_good else "none of this run"
        raise store.CheckpointWriteError(
            f"checkpoint: could not save step {step} in {self.folder}: {problem}; nothing was published, the last "
            f"good checkpoint is {kept}"
        )

    def _hash_when_written(self, written, tmp: Path) -> tuple[dict | None, str | None]:
        """Background thread: wait for DCP's write, then hash this rank's files (gathered on rank 0
        over the async group, which only this thread uses while a save is in flight). A rank whose
        write failed still joins the gather (else the others would wait in it forever) and returns
        its problem: (checksums on rank 0 or None, this rank's problem or None)."""
        problem = None
        try:
            written.result()
        except (Exception, CheckpointException) as e:
            problem = f"the background write failed on rank {self.rank}: {store.cause_of(e)}"
        return self._gather_checksums(tmp, group=self.async_group, hash_files=problem is None), problem

    def _gather_checksums(self, tmp: Path, group, hash_files: bool = True) -> dict | None:
        """Each rank hashes the files it wrote; rank 0 gets {file: crc32} of all of them, others None."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = {}
        try:
            if hash_files:
                mine = store.checksums(tmp, store.owned_files(tmp, self.rank, world))
        except OSError as e:  # rank 0's publish reports it (write_marker finds a file without checksum)
            print(f"plait-train: rank {self.rank}: checkpoint: cannot read back {tmp}: {store.cause_of(e)}", flush=True)
        if world == 1:
            return mine
        parts = [None] * world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        return {name: crc for part in parts for name, crc in part.items()} if self.rank == 0 else None

    def _publish(self, step: int, tmp: Path, meta: dict, how: str) -> None:
        """Rank 0: marker (checksums, run id, publication number), atomic rename, pruning."""
        meta = dict(meta)
        crcs = meta.pop("crcs")
        meta.update(run_id=self.run_id, published=store.next_publication(self.folder))
        store.write_marker(tmp, meta, crcs)
        final = self.folder / store.step_name(step)
        # A checkpoint this run rejected (damaged) is never overwritten: it is renamed and kept.
        kept = store.publish(tmp, final, keep_as=f"rejected-{self.run_id}" if str(final) in self._rejected else None)
        if kept is not None:
            self._log(f"kept the damaged checkpoint that held this step as {kept.name}")
        if not meta["model_only"]:
            self.last_good = (step, final)
        removed = store.prune(self.folder, self.c.keep_last)
        pruned = f", removed {', '.join(p.name for p in removed)}" if removed else ""
        self._log(f"saved {final} ({how}){pruned}")

    def _poll(self) -> None:
        """Finish the save in flight once it is written on EVERY rank (one CPU all-reduce per step
        while it is in flight): each rank's future completes when it will, and a rank that saw its
        own failure alone would raise while the others went on into the next step's collectives."""
        future, step, tmp, meta = self.pending
        if self._done_everywhere(future.done()):
            self._finish(future, step, tmp, meta)

    def _done_everywhere(self, done: bool) -> bool:
        if self.control_group is None:
            return done
        import torch

        flag = torch.tensor([1 if done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control_group)
        return bool(flag.item())

    def _agreed(self, problem: str | None) -> list:
        """Every rank's problem (None: none) on every rank, over the CPU control group."""
        if self.control_group is None:
            return _all_gather(problem)
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, problem, group=self.control_group)
        return out

    def _wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, published)."""
        if self.pending is not None:
            t0 = time.perf_counter()
            wait_for([self.pending[0]])  # its failure, if any, is reported by _finish
            self._finish(*self.pending, waited=time.perf_counter() - t0)

    def _finish(self, future, step: int, tmp: Path, meta: dict, waited: float = 0.0) -> None:
        """Every rank, at the same step: publish the written save (rank 0), or raise one line on
        every rank when any rank's write or rank 0's publish failed."""
        self.pending = None
        crcs, problem = None, None
        try:
            crcs, problem = future.result()
        except (Exception, CheckpointException) as e:  # the checksum gather itself failed
            problem = f"the background write failed on rank {self.rank}: {store.cause_of(e)}"
        self._raise_if_failed(step, tmp, self._agreed(problem))
        verdict = None
        if self.rank == 0:
            try:
                self._publish(step, tmp, dict(meta, crcs=crcs), f"written in the background, waited {waited:.2f} s")
            except (OSError, CheckpointError) as e:
                verdict = store.cause_of(e)
        self._raise_if_failed(step, tmp, [self._agreed(verdict)[0]])
        if self.rank != 0 and not meta["model_only"]:
            self.last_good = (step, self.folder / store.step_name(step))  # rank 0 published it

    def _hf_output(self, step: int) -> Path:
        return self.folder / f"hf-{store.step_name(step)}"

    def _export_hf(self, step: int) -> None:
        # Every rank writes its share of the layers (hf_sharded.py); rank 0 the index and config.
        out = hf_sharded.export_hf_sharded(
            self.model, self._hf_output(step), self.config.model.name,
            self.config.model.flavor, hf_export.DTYPES[self.c.export_dtype],
            getattr(self.model, "args", None),  # the flavor with this run's [model] overrides
        )
        self._log(f"exported {out} ({self.c.export_dtype}, Hugging Face safetensors)")

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
        self._wait()
        if self.writer is not None:
            self.writer.shutdown()
            self.writer = None
        _barrier()
