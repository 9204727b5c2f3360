"""Checkpoints under pipeline parallel: saved by a PP 2 run, resumed without PP and under PP 4.

Stage modules keep the unsplit model's parameter names, so a DCP checkpoint of a PP run holds the
same keys as any other layout's (each pp rank writes its stages' part). The PP 2 run trains 4 steps
and saves at step 2; runs resumed from that checkpoint on one rank (PP 1) and on PP 4 (1F1B, the
first and last stage holding only the embedding / the output head) must reproduce steps 3-4 within
1e-5 (fp32, deterministic; another layout sums in another order). Every run validates at steps 2
and 4 (`Pipeline.eval_step` under PP): the step-4 validation losses agree too, and the PP 2 run's
validation at step 2 (after which torch's shape inference runs again) does not move its training
losses away from the resumed runs', which did not validate at step 2.
"""

import shutil
from pathlib import Path

import torch

from plait.testing import run_on_ranks
from plait.testing.trainer import parity_args

STEPS = 4
COMMON = [
    *parity_args(steps=STEPS, lr=1e-3), "--metrics.tensorboard", "false", "--metrics.log_freq", "1",
    "--model.n_layers", "2", "--training.local_batch_size", "8",
    "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    "--data.val_dataset", "builtin", "--data.val_interval", "2", "--data.val_steps", "1",
]  # fmt: skip
PP = ["--parallelism.dp_shard", "1", "--parallelism.pipeline_microbatch_size", "2"]
LAYOUTS = {
    2: ["--parallelism.pp", "2", *PP],
    1: [],
    4: ["--parallelism.pp", "4", "--parallelism.layers_per_stage", "0,1,1,0", *PP],
}


def _train(rank: int, world_size: int, dump: str, args: list[str]) -> tuple[list[dict], dict[int, float]]:
    """Metrics rows (rank 0) and the validation losses by step (every rank)."""
    from plait.testing.trainer import train_in_process
    from plait.trainer.train import Trainer

    validations, validate_loss = {}, Trainer.validate_loss

    def recording(self):
        validations[self.step] = value = validate_loss(self)
        return value

    Trainer.validate_loss = recording
    try:
        rows = train_in_process(Path(dump), "--config", "llama3_debugmodel.toml", *COMMON, *args)
    finally:
        Trainer.validate_loss = validate_loss
    return rows, validations


def _losses(rows: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in rows}


def test_pp2_checkpoint_resumes_on_pp1_and_pp4(tmp_path):
    saved = tmp_path / "pp2"
    rows, straight_val = run_on_ranks(_train, 2, str(saved), LAYOUTS[2], timeout=300)[0]
    straight = _losses(rows)
    assert sorted(straight) == list(range(1, STEPS + 1)) and sorted(straight_val) == [2, 4]
    for ranks in (1, 4):
        dump = tmp_path / f"pp{ranks}"
        shutil.copytree(saved / "checkpoints" / "step-000002", dump / "checkpoints" / "step-000002")
        rows, val = run_on_ranks(_train, ranks, str(dump), LAYOUTS[ranks], timeout=300)[0]
        resumed = _losses(rows)
        assert sorted(resumed) == [3, 4], (ranks, resumed)
        assert abs(val[4] - straight_val[4]) <= 1e-5, (ranks, val, straight_val)
        for step in (3, 4):
            assert abs(resumed[step] - straight[step]) <= 1e-5, (ranks, step, resumed[step], straight[step])


def test_pp2_sigkill_resume_is_bit_identical_and_the_hf_export_holds_every_stage(tmp_path):
    """Real processes under PP 2 (torchrun through plait-train): a run SIGKILLed right after its
    step-2 save and started again with the same command reproduces the uninterrupted run's losses
    exactly; the uninterrupted run's Hugging Face export (each stage's ranks write their layers)
    holds exactly the weights of its last DCP checkpoint."""
    from plait.checkpoint.hf_export import read_hf_state, read_model_state
    from plait.testing.trainer import run_cli
    from plait.trainer.checkpoint.hf_export import recorded_args

    args = [*COMMON, "--nproc-per-node", "2", *LAYOUTS[2]]
    straight = tmp_path / "straight"
    run_cli(straight, *args, "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32",
            timeout=300)
    killed = tmp_path / "killed"
    result = run_cli(killed, *args, env={"PLAIT_TEST_KILL_AFTER_SAVE": "2"}, expect=None, timeout=300)
    assert result.returncode != 0
    result = run_cli(killed, *args, timeout=300)
    assert "step-000002 (step 2, same layout, RNG restored)" in result.stdout, result.stdout[-2000:]
    expected, resumed = _metrics(straight), _metrics(killed)
    for step in range(3, STEPS + 1):
        assert resumed[step] == expected[step], (step, resumed[step], expected[step])

    saved, meta = read_model_state(straight / "checkpoints" / "step-000004")
    hf_folder = straight / "checkpoints" / "hf-step-000004"
    assert len(list(hf_folder.glob("model-*.safetensors"))) == 2  # one writer per stage
    exported = read_hf_state(hf_folder, "llama3", "debugmodel", recorded_args("llama3", "debugmodel", meta))
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


def _metrics(dump: Path) -> dict[int, float]:
    from plait.testing.trainer import training_rows

    return {row["step"]: row["loss"] for row in training_rows(dump)}  # not the val_loss rows
