"""Resume: choose the newest verified checkpoint every rank agrees on, check it fits this model,
load it through DCP (resharding into this run's layout), or load `initial_load_path`'s weights."""

import os
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from plait.checkpoint import hf_export, hf_output, hf_sharded, reader, state, store
from plait.checkpoint.collect import all_gather
from plait.checkpoint.store import CheckpointError

from ..log import log
from . import train_state

KERNEL_FLAGS = ("foreach", "fused", "capturable")


class Resume:
    """CheckpointManager's resume half (manager.py holds the state it reads)."""

    def load(self) -> int:
        """Restore what the configuration asks for; return the last completed step (0: a new run)."""
        # Shapes on every rank before rank 0 decides alone (no rank may enter a collective by itself).
        self._shapes = {name: tuple(t.shape) for name, t in state.model_state(self.model).items()}
        if self.c.enable and self.c.last_save_in_hf and not self.c.create_seed_checkpoint:
            # Before step 1, not after the whole run: the export's folder must be ours to write.
            output = self._hf_output(self.config.training.steps)
            reader.agree(lambda: str(hf_output.check_output(output, "checkpoint.last_save_in_hf")))
        if self.c.enable and not self.c.create_seed_checkpoint:
            path, meta = self._choose_verified()
            if path is not None:
                return self._load(Path(path), meta)
            reader.agree(self._fresh_start_allowed)
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

    def _choose_verified(self) -> tuple[str | None, dict | None]:
        """Rank 0 chooses, every rank verifies a share of the checksums; auto-resume falls back to
        the checkpoint published before a damaged one, an explicit load_step fails."""
        explicit = f"checkpoint.load_step = {self.c.load_step}" if self.c.load_step >= 0 else ""
        return reader.choose_verified(self._choose, self.writer.rejected, explicit)

    def _choose(self, skip: set[str]) -> tuple[str | None, dict | None]:
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
            path, meta, warnings = store.newest_complete(self.folder, skip=skip)
            for warning in warnings:
                log.warning(f"checkpoint: {warning}")
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
        # This run's kernel (fused / foreach: optimizer.implementation, state_dtype) over the saved
        # one's, before torch places the loaded step counts by it (fused: on the parameters' device).
        for saved, live in zip(sd[state.OPTIMIZER]["param_groups"], self.optimizer.param_groups):
            saved.update({k: live[k] for k in KERNEL_FLAGS if k in live})
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
        self._note_state_dtype(meta)
        if changes:
            self._log(
                f"this run's settings replace the checkpoint's: {', '.join(changes)}; the schedule continues at "
                f"step {step + 1} with lr {self.scheduler.get_last_lr()[0]:.3g}"
            )
        self.writer.last_good = self.resumed_from = (step, path)
        return step

    def _note_state_dtype(self, meta: dict) -> None:
        """AdamW's moments saved in another optimizer.state_dtype (fp32 / bf16) were converted on
        loading: DCP copies the saved values into this run's state tensors (fp32 -> bf16 rounds to
        nearest, once; bf16 -> fp32 is exact). Checkpoints from before the record hold fp32."""
        saved, ours = meta.get("optimizer_state_dtype", "fp32"), self.config.optimizer.state_dtype
        if saved != ours:
            how = "rounded to nearest once" if ours == "bf16" else "exactly"
            self._log(f"AdamW's moments were saved in {saved} and are converted to {ours} ({how}): "
                      f"optimizer.state_dtype = {ours} replaces the checkpoint's {saved}")  # fmt: skip

    def _load_rng(self, path: Path, meta: dict, step: int) -> bool:
        """Restore this rank's RNG states; when any rank's RNG file is damaged, every rank is
        re-seeded from job.seed and the step instead (a warning says so) and the run goes on."""
        problem = meta.get(store.RNG_PROBLEM)
        if problem is None:
            try:
                state.load_rng(path, self.rank)
            except CheckpointError as e:
                problem = str(e)
        problems = [p for p in all_gather(problem) if p]
        if not problems:
            return True
        state.reseed(self.config.job.seed + step)
        log.warning(
            f"checkpoint: {problems[0]}: model, optimizer and data position are intact, so the run resumes, with "
            f"every random number generator re-seeded from job.seed + {step} instead of restored (random draws "
            "from here on differ from an uninterrupted run's)"
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

        _, meta = reader.agree(decide)
        problem, _ = reader.verify(path, meta)  # only its model is loaded
        if problem:
            raise CheckpointError(f"{problem}; checkpoint.initial_load_path names it: use another checkpoint")
        sd = {state.MODEL: state.model_state(self.model)}
        self._dcp_load(sd, path)
        state.load_model(self.model, sd[state.MODEL])
        self._log(f"initial weights from {path} (model only); training starts at step 1")
