"""Save a distributed state dict as one checkpoint that is either complete or absent.

Every rank writes its part through DCP into `step-N.tmp-<run id>` and hashes the files it wrote;
rank 0 writes the `.complete` marker with every rank's checksums, renames the folder (store.py)
and prunes to `keep_last`. A write that fails on any rank fails on every rank at the same step,
with one line naming the folder, the cause and the last good checkpoint, and the temporary folder
is removed.

One writer per folder: rank 0 takes `<folder>/.plait-checkpoint.lock` (folder_lock.py) when the
writer is made and every rank learns the verdict, so a second writer on the folder (another run id,
process or host) is refused in one line on every rank instead of replacing the first one's
checkpoints; `close()` gives it back. `lock=False` for a caller that holds it already (plait-train).

`background=True` stages the state into CPU memory and lets DCP write it from a thread over a
gloo group of its own; a thread of ours then hashes this rank's files. The ranks agree on the CPU
(`poll`, every step: no device sync) when the write finished everywhere, so all of them learn of
a failure at the same step; one save is in flight at a time.

    writer = CheckpointWriter(folder, run_id, keep_last=3, background=True)
    writer.save(step, state_dict, meta={"step": step, "model_only": False})
    ...  # every step: writer.poll()
    writer.close()
"""

import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from plait.mesh.errors import ConfigError

from . import state, store
from .collect import KILL_AFTER_SAVE, KILL_DURING_SAVE, SLOW_SAVE, all_gather, barrier, broadcast, test_kill
from .folder_lock import CHECKPOINT_LOCK_NAME, FolderLock
from .store import CheckpointError

log = logging.getLogger("plait.checkpoint")


class CheckpointWriter:
    """Atomic, checksummed saves into `folder`; `last_good` is the newest full state published."""

    def __init__(self, folder: Path, run_id: str, keep_last: int = 0, background: bool = False, lock: bool = True):
        self.folder, self.run_id, self.keep_last = Path(folder), run_id, keep_last
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.lock = self._take_lock() if lock else None
        self.pending = None  # (future, step, temp path, marker meta) of the background save in flight
        self.hasher = None  # the thread that hashes a background save's files once DCP wrote them
        self.last_good: tuple[int, Path] | None = None  # (step, path) of the newest full state on disk
        self.rejected: set[str] = set()  # rank 0: checkpoints found damaged (kept, never overwritten)
        self.async_group = self.control_group = None
        if background and dist.is_initialized():
            # Collectives of the background writer must not interleave with training's.
            self.async_group = dist.new_group(backend="gloo")
            self.control_group = dist.new_group(backend="gloo")

    def save(self, step: int, sd: dict, meta: dict, background: bool = False, rng: bool = True) -> None:
        """Every rank: write `sd` as step `step` (meta: the marker's, with "model_only"); `rng`
        also saves each rank's random number generators. Raises CheckpointWriteError (one line)."""
        self.wait()
        t0 = time.perf_counter()
        tmp = store.temp_path(self.folder, step, self.run_id)
        problem = None
        try:  # a write that fails on one rank fails on every rank, with one line (no rank waits alone)
            tmp.mkdir(parents=True, exist_ok=True)
            if rng:
                state.save_rng(tmp, self.rank)
        except (OSError, RuntimeError) as e:  # torch.save's zip writer raises RuntimeError on a full disk
            problem = store.cause_of(e)
        self._raise_if_failed(step, tmp, all_gather(problem))
        if background:
            self._save_in_background(step, sd, meta, tmp, t0)
            return
        if not meta["model_only"] and os.environ.get(SLOW_SAVE):
            time.sleep(float(os.environ[SLOW_SAVE]))
        try:
            with store.single_process_quiet():
                dcp.save(sd, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure: all are here
            self._raise_if_failed(step, tmp, [store.cause_of(e)])
        test_kill(KILL_DURING_SAVE, step)
        crcs = self._gather_checksums(tmp, group=None)  # every rank's files are written and hashed
        verdict = self._publish_on_rank_0(step, tmp, meta, crcs, f"{time.perf_counter() - t0:.2f} s")
        self._raise_if_failed(step, tmp, [broadcast(verdict)])
        if not meta["model_only"]:  # every rank knows the last good checkpoint (for its error lines)
            self.last_good = (step, self.folder / store.step_name(step))
        if os.environ.get(KILL_AFTER_SAVE) == str(step):
            barrier()  # published before anyone dies
            test_kill(KILL_AFTER_SAVE, step)

    def _save_in_background(self, step: int, sd: dict, meta: dict, tmp: Path, t0: float) -> None:
        problem, written = None, None
        try:
            with store.single_process_quiet():
                written = dcp.async_save(
                    sd, checkpoint_id=str(tmp), process_group=self.async_group, no_dist=not dist.is_initialized()
                )
        except (Exception, CheckpointException) as e:  # staging (out of memory), the writer's set-up
            problem = f"staging the background save failed on rank {self.rank}: {store.cause_of(e)}"
        # Every rank, now: one that raised alone here would leave the others waiting in the next
        # step's collectives (their own writes go on in their threads, and end with the process).
        self._raise_if_failed(step, tmp, self._agreed(problem))
        if self.hasher is None:
            self.hasher = ThreadPoolExecutor(1, thread_name_prefix="plait-checksums")
        future = self.hasher.submit(self._hash_when_written, written, tmp)
        self.pending = (future, step, tmp, meta)
        log.info(f"step {step} staged in {time.perf_counter() - t0:.2f} s, writing in the background")

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
            log.info(f"cannot read back {tmp}: {store.cause_of(e)}", extra={"every_rank": True})
        if world == 1:
            return mine
        parts = [None] * world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        return {name: crc for part in parts for name, crc in part.items()} if self.rank == 0 else None

    def _publish_on_rank_0(self, step: int, tmp: Path, meta: dict, crcs: dict | None, how: str) -> str | None:
        """Rank 0 publishes the written save; its problem, to share (None: published, or another rank)."""
        if self.rank != 0:
            return None
        try:
            self._publish(step, tmp, dict(meta, crcs=crcs), how)
        except (OSError, CheckpointError) as e:
            return store.cause_of(e)
        except Exception as e:  # noqa: BLE001 (anything else too: the other ranks wait for the verdict)
            return f"publishing failed on rank 0: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        return None

    def _publish(self, step: int, tmp: Path, meta: dict, how: str) -> None:
        """Rank 0: marker (checksums, run id, publication number), atomic rename, pruning."""
        meta = dict(meta)
        crcs = meta.pop("crcs")
        meta.update(run_id=self.run_id, published=store.next_publication(self.folder))
        store.write_marker(tmp, meta, crcs)
        final = self.folder / store.step_name(step)
        # A checkpoint found damaged is never overwritten: it is renamed and kept.
        kept = store.publish(tmp, final, keep_as=f"rejected-{self.run_id}" if str(final) in self.rejected else None)
        if kept is not None:
            log.info(f"kept the damaged checkpoint that held this step as {kept.name}")
        if not meta["model_only"]:
            self.last_good = (step, final)
        removed = store.prune(self.folder, self.keep_last)
        pruned = f", removed {', '.join(p.name for p in removed)}" if removed else ""
        log.info(f"saved {final} ({how}){pruned}")

    def poll(self) -> None:
        """Every rank, every step: finish the save in flight once it is written on EVERY rank (one
        CPU all-reduce per step while it is in flight): each rank's write completes when it will,
        and a rank that saw its own failure alone would raise while the others went on into the
        next step's collectives."""
        if self.pending is None:
            return
        future, step, tmp, meta = self.pending
        if self._done_everywhere(future.done()):
            self._finish(future, step, tmp, meta)

    def _done_everywhere(self, done: bool) -> bool:
        if self.control_group is None:
            return done
        flag = torch.tensor([1 if done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control_group)
        return bool(flag.item())

    def _agreed(self, problem: str | None) -> list:
        """Every rank's problem (None: none) on every rank, over the CPU control group."""
        if self.control_group is None:
            return all_gather(problem)
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, problem, group=self.control_group)
        return out

    def wait(self) -> None:
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
        verdict = self._publish_on_rank_0(step, tmp, meta, crcs, f"written in the background, waited {waited:.2f} s")
        self._raise_if_failed(step, tmp, [self._agreed(verdict)[0]])
        if self.rank != 0 and not meta["model_only"]:
            self.last_good = (step, self.folder / store.step_name(step))  # rank 0 published it

    def _take_lock(self) -> "_WriterLock | None":
        """Rank 0 locks the folder; every rank raises its ConfigError (one line) or goes on."""
        lock, verdict = None, ("ok", None)
        if self.rank == 0:
            lock = _WriterLock(str(self.folder), CHECKPOINT_LOCK_NAME, "the checkpoint folder",
                               note={"run_id": self.run_id})  # fmt: skip
            try:
                verdict = ("ok", lock.acquire())
            except ConfigError as e:
                verdict = ("error", str(e))
        kind, value = broadcast(verdict)
        if kind == "error":
            raise ConfigError(value)
        if value:
            log.warning(value)
        return lock

    def close(self) -> None:
        """Every rank, at the end: wait for the save in flight, publish it, stop the hashing thread,
        give the folder's lock back."""
        self.wait()
        if self.hasher is not None:
            self.hasher.shutdown()
            self.hasher = None
        barrier()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class _WriterLock(FolderLock):
    """A folder lock that this very process may hold already: then it is another writer's (a
    requeued container's reused pid has another start time, and stays stale)."""

    def _stale(self, holder: dict) -> bool:
        same = (holder.get("pid"), holder.get("host"), holder.get("start"))
        if same == (self.owner["pid"], self.owner["host"], self.owner["start"]):
            return False
        return super()._stale(holder)
