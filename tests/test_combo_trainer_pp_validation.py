"""plait-train's pipeline settings are checked before any collective: one line naming the key and
the fix (plain validation, no process group)."""

import pytest

from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import pipeline_microbatches, validate

PP2 = [("parallelism.pp", "2"), ("parallelism.dp_shard", "1"), ("training.local_batch_size", "4"),
       ("model.n_layers", "2")]  # fmt: skip


def _validate(*overrides, world_size=2):
    return validate(build_config(None, [*PP2, *overrides]), world_size=world_size)


def test_a_pipeline_layout_validates():
    plan = _validate(("parallelism.pipeline_schedule", "interleaved1f1b"), ("parallelism.pipeline_virtual_stages", "2"),
                     ("parallelism.layers_per_stage", "0,1,1,0"), ("parallelism.pipeline_microbatch_size", "1"))
    assert plan.dims.pp == 2 and "pp" in plan.parallel_modules
    # The accumulation micro-batches run as one local batch: 4 rows x 2 / 2 rows per micro-batch.
    config = build_config(None, [*PP2, ("training.gradient_accumulation_steps", "2"),
                                 ("parallelism.pipeline_microbatch_size", "2")])
    assert pipeline_microbatches(config) == 4


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([("parallelism.pipeline_schedule", "OneFOneB")], "parallelism.pipeline_schedule = 'OneFOneB'"),
        ([("parallelism.pipeline_microbatch_size", "3")], "parallelism.pipeline_microbatch_size = 3"),
        # 1F1B on 2 stages needs 2 micro-batches; 4 rows of 4 give 1.
        ([("parallelism.pipeline_microbatch_size", "4")], "parallelism.pipeline_schedule = '1F1B' needs"),
        ([("parallelism.layers_per_stage", "2,1")], "parallelism.layers_per_stage = [2, 1] sums to 3"),
        ([("parallelism.pipeline_schedule", "ZBVZeroBubble")], "parallelism.pipeline_schedule = 'ZBVZeroBubble' is a V"),
        ([("model.n_layers", "3")], "parallelism.pp = 2 x parallelism.pipeline_virtual_stages = 1"),
        ([("model.tie_embeddings", "true")], "parallelism.pp > 1 puts the embedding"),
    ],
)
def test_bad_pipeline_settings_are_one_line_errors(overrides, key):
    with pytest.raises(ConfigError) as e:
        _validate(*overrides)
    message = str(e.value)
    assert key in message and "\n" not in message, message


def test_sequence_parallel_across_stages_validates():
    # Every stage gets the RoPE positions (a later one cannot size them from sequence-sharded
    # hidden states): tensor parallel keeps its default sequence parallel under pp.
    plan = _validate(("parallelism.tp", "2"), world_size=4)
    assert plan.dims.tp == 2 and plan.dims.pp == 2
