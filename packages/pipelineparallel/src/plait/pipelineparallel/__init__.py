"""plait.pipelineparallel: pipeline stages cut from a model's plain data, run by torch's schedules.

`validate_pipeline_parallel` (before any collective) -> `split_stages` (this rank's stage modules)
-> per stage: tensor / data parallel, materialise -> `build_pipeline` (torch's schedule by name)
-> `Pipeline.step(tokens, labels, scale, positions=..., document_positions=...)` each step.
A model plait did not write: name its pieces in `ModelParts` and cut with `split_user_model`.
"""

from .config import (
    SCHEDULES,
    PipelineConfigError,
    n_microbatches,
    schedule_name,
    schedule_style,
    validate_pipeline_parallel,
)
from .schedule import Pipeline, ScaledLoss, build_pipeline
from .split import Stage, split_stages, stage_blocks, stage_indices, stage_layer_counts
from .user_model import ModelParts, UserModelStage, split_user_model

__version__ = "0.1.1"

__all__ = [
    "SCHEDULES",
    "ModelParts",
    "Pipeline",
    "PipelineConfigError",
    "ScaledLoss",
    "Stage",
    "UserModelStage",
    "build_pipeline",
    "n_microbatches",
    "schedule_name",
    "schedule_style",
    "split_stages",
    "split_user_model",
    "stage_blocks",
    "stage_indices",
    "stage_layer_counts",
    "validate_pipeline_parallel",
]
