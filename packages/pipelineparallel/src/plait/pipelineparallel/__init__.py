"""plait.pipelineparallel: pipeline stages cut from a model's plain data, run by torch's schedules.

`validate_pipeline_parallel` (before any collective) -> `split_stages` (this rank's stage modules)
-> per stage: tensor / data parallel, materialise -> `build_pipeline` (torch's schedule by name)
-> `Pipeline.step(tokens, labels, scale, positions=..., document_positions=...)` each step.
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

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineConfigError",
    "ScaledLoss",
    "Stage",
    "build_pipeline",
    "n_microbatches",
    "schedule_name",
    "schedule_style",
    "split_stages",
    "stage_blocks",
    "stage_indices",
    "stage_layer_counts",
    "validate_pipeline_parallel",
]
