"""Save: when (every `interval` steps, at the end, on SIGTERM), what (model, optimizer, LR schedule,
data position; the model alone for a seed), and the Hugging Face export after the last step. The
writing itself (atomic, checksummed, in the background) is plait-checkpoint's CheckpointWriter."""

import time
from pathlib import Path

from plait.checkpoint import hf_export, hf_sharded, state, store

from . import train_state


class Save:
    """CheckpointManager's save half (manager.py holds the state it writes)."""

    def due(self, step: int, last: bool = False, stopping: bool = False) -> bool:
        """Whether `after_step` saves at this step (the trainer checks the state is finite first)."""
        return self.c.enable and (last or stopping or (self.c.interval > 0 and step % self.c.interval == 0))

    def after_step(self, step: int, last: bool = False, stopping: bool = False) -> None:
        """Called on every rank after every step: publish a finished async save, save when due."""
        self.writer.poll()
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
            "optimizer_state_dtype": c.optimizer.state_dtype,  # a resume under another converts them
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "format": 1,
        }

    def _save(self, step: int, model_only: bool, background: bool) -> None:
        if model_only:
            sd = {state.MODEL: state.model_state(self.model)}
        else:
            sd = state.full_state(self.model, self.optimizer)
            sd[state.TRAIN_STATE] = train_state.train_state(step, self.scheduler, self.loader, self.config)
        self.writer.save(step, sd, self._meta(step, model_only), background=background, rng=not model_only)

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
