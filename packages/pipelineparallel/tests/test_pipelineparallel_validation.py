"""Every bad pipeline layout fails in validate_pipeline_parallel: one line, the key and the fix.

Validation reads plain data only (no process group exists here): it is what runs before any
collective.
"""

import pytest

from plait.pipelineparallel import (
    SCHEDULES,
    PipelineConfigError,
    n_microbatches,
    schedule_name,
    schedule_style,
    validate_pipeline_parallel,
)

EDGES = [["tok_embeddings"], ["norm", "output"]]


def info(n_blocks=8, edges=EDGES):
    return {"blocks": [f"layers.{i}" for i in range(n_blocks)], "edge_units": edges}


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(pp=0), ["parallelism.pp = 0", ">= 1"]),
        (dict(schedule="OneFOneB"), ["parallelism.pipeline_schedule = 'OneFOneB'", "GPipe, 1F1B, Interleaved1F1B"]),
        (dict(info=info(6), pp=4), ["parallelism.pp = 4", "do not divide the model's 6 blocks",
                                    "parallelism.layers_per_stage"]),
        (dict(layers_per_stage=[3, 3]), ["parallelism.layers_per_stage = [3, 3] sums to 6", "sum to 8"]),
        (dict(layers_per_stage=[8]), ["one integer per stage", "2 of them"]),
        (dict(layers_per_stage=[4, 0, 4, 0], virtual_stages=2, schedule="Interleaved1F1B", n_mb=4),
         ["every middle stage needs at least one block"]),
        (dict(schedule="1F1B", n_mb=1), ["'1F1B' needs at least as many micro-batches as parallelism.pp = 2",
                                         "parallelism.pipeline_microbatch_size"]),
        (dict(schedule="DualPipeV", virtual_stages=2, n_mb=3), ["the 4 stages (4), got 3"]),
        (dict(schedule="Interleaved1F1B", virtual_stages=2, n_mb=5), ["rounds", "multiple of 2"]),
        (dict(schedule="ZBVZeroBubble", virtual_stages=1), ["V schedule", "exactly 2 stages per rank",
                                                           "parallelism.pipeline_virtual_stages = 1"]),
        (dict(schedule="GPipe", virtual_stages=2), ["runs one stage per rank", "Interleaved1F1B"]),
        (dict(info=info(8, edges=[])), ["tied embedding", "model.tie_embeddings = false", "parallelism.pp = 1"]),
        (dict(n_mb=0), ["parallelism.pipeline_microbatch_size"]),
    ],
)
def test_bad_layouts_name_the_key_and_the_fix(kwargs, words):
    args = dict(info=info(), pp=2, schedule="1F1B", n_mb=4, layers_per_stage=None, virtual_stages=1)
    args.update(kwargs)
    with pytest.raises(PipelineConfigError) as err:
        validate_pipeline_parallel(
            args["info"], args["pp"], args["schedule"], args["n_mb"], args["layers_per_stage"], args["virtual_stages"]
        )
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "pp, schedule, n_mb, layers_per_stage, virtual",
    [
        (1, "anything at pp 1", 1, None, 1),  # pp = 1: nothing to check
        (2, "gpipe", 1, None, 1),  # names are case-insensitive; GPipe takes one micro-batch
        (2, "1F1B", 2, [3, 5], 1),
        (4, "Interleaved1F1B", 8, None, 2),
        (2, "InterleavedZeroBubble", 2, [1, 3, 3, 1], 2),
        (2, "ZBVZeroBubble", 4, None, 2),
        (2, "DualPipeV", 4, [0, 4, 4, 0], 2),
        (2, "LoopedBFS", 1, None, 4),
    ],
)
def test_good_layouts_pass(pp, schedule, n_mb, layers_per_stage, virtual):
    validate_pipeline_parallel(info(), pp, schedule, n_mb, layers_per_stage, virtual)


def test_names_styles_and_microbatches():
    assert schedule_name("interleaved1f1b") == "Interleaved1F1B"
    assert {n: schedule_style(n) for n in SCHEDULES if schedule_style(n) == "v"} == {
        "ZBVZeroBubble": "v", "DualPipeV": "v"
    }
    assert n_microbatches(8, 2) == 4
    with pytest.raises(PipelineConfigError, match=r"pipeline_microbatch_size = 3 must be a positive divisor .* \[1, 2, 4, 8\]"):
        n_microbatches(8, 3)


def test_every_name_is_a_torch_schedule():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES:
        assert get_schedule_class(name).__name__.lower().endswith(name.lower())
