"""The measured side of the planner's proof: one real training step of this rank, counted the
same way as the plan (plait.trainer.plan.trace.measure_step on real tensors and a real process
group). Every rank of a run calls it at the same point (it is collective)."""

from .trace import StepTrace, measure_step, micro_batch


def measured_step(argv: list[str]) -> StepTrace:
    """Build the trainer of `plait-train ARGV` (validation, meshes, parallelize, optimizer, as a
    run does) on this process group and run one step of gradient_accumulation_steps micro-batches."""
    import torch

    from ..cli import DEFAULT_CONFIG, parse_args
    from ..config import build_config, load_toml
    from ..train import Trainer

    parsed = parse_args(argv)
    config = build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)
    threads = torch.get_num_threads()
    trainer = Trainer(config)
    try:
        batches = [micro_batch(config) for _ in range(config.training.gradient_accumulation_steps)]
        return measure_step(trainer, batches, accumulation=1)
    finally:
        trainer.release(0)
        torch.set_num_threads(threads)
