"""Weights & Biases beside TensorBoard (`metrics.wandb`): rank 0 logs the scalars metrics.py writes to
TensorBoard, at the same steps, into one W&B run whose config is the run's resolved configuration.

wandb is optional (`pip install plait-trainer[wandb]`); validation checks it is importable before
any collective. Settings left empty fall back to wandb's own environment variables (WANDB_PROJECT,
WANDB_ENTITY, WANDB_NAME, WANDB_MODE, WANDB_DIR, WANDB_RUN_ID / WANDB_RESUME).
"""

import dataclasses
import os

from .config import Config, ConfigError
from .log import log


def check_wandb(config: Config) -> None:
    """With metrics.wandb on, wandb must import: else one ConfigError line naming the fix."""
    if not config.metrics.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"metrics.wandb = true needs wandb, which does not import here ({e}): pip install 'plait-trainer[wandb]' "
            "(or pip install wandb), or set metrics.wandb = false."
        ) from None


class WandbRun:
    """One W&B run (rank 0): `log` the same scalars TensorBoard gets, `finish` at the end."""

    def __init__(self, config: Config, dump_folder: str):
        import wandb

        m = config.metrics
        try:
            self.run = wandb.init(
                project=m.wandb_project or None,
                entity=m.wandb_entity or None,
                name=m.wandb_run_name or None,
                # WANDB_DIR wins; without it the run's files go beside tb/ and metrics.jsonl.
                dir=None if os.environ.get("WANDB_DIR") else dump_folder,
                config=dataclasses.asdict(config),
            )
        except Exception as e:  # no API key, no network, a bad entity: one line, not wandb's traceback
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"metrics.wandb = true: wandb.init failed ({why}): "
                "run `wandb login` (or set WANDB_API_KEY), set WANDB_MODE=offline to log without a server, or set "
                "metrics.wandb = false."
            ) from None
        # Rows are flushed every log_freq steps while a validation loss is logged at its own step, so
        # the steps reach wandb out of order (val at 5, then rows 1-10): plot against our `step`
        # rather than wandb's own, which must increase and would drop the earlier rows.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def finish(self, failed: bool = False) -> None:
        """End the run (marked failed on an error path). Best effort: an upload that fails here must
        neither turn a finished training into an error nor hide the error that ends a failed one."""
        try:
            self.run.finish(exit_code=1 if failed else 0)
        except Exception as e:
            log.warning(f"wandb: finishing the run failed ({e}); metrics.jsonl holds every row.")
