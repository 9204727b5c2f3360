"""The measured side of the planner's proof: one real training step of this rank, counted the
same way as the plan (plait.plan.trace.measure_step on real tensors and a real process
group). Every rank of a run calls it at the same point (it is collective)."""

from .trace import StepTrace, measure_step, micro_batch


def measured_step(argv: list[str]) -> StepTrace:
    """Build the trainer of `plait-train ARGV` (validation, meshes, parallelize, optimizer, as a
    run does) on this process group and run one step of gradient_accumulation_steps micro-batches."""
    import torch

    from plait.trainer.cli import DEFAULT_CONFIG, parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.train import Trainer

    parsed = parse_args(argv)
    config = build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)
    threads = torch.get_num_threads()
    trainer = Trainer(config)
    try:
        batches = [micro_batch(config) for _ in range(config.training.gradient_accumulation_steps)]
        return measure_step(trainer.runner, batches, accumulation=1)
    finally:
        trainer.release(0)
        torch.set_num_threads(threads)


def resident_step_peak(argv: list[str]) -> tuple[int, int]:
    """(bytes the process's resident set grew to above its size before the step, bytes the
    parameters, buffers and optimizer state held then) for one real step of `plait-train ARGV` on one process: an
    allocator-level measure independent of torch's tracker (run it in a fresh process, where the
    step is the largest thing it ever allocated; Linux resets the high-water mark before the step)."""
    import torch

    from plait.trainer.cli import DEFAULT_CONFIG, parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.train import Trainer

    parsed = parse_args(argv)
    config = build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)
    trainer = Trainer(config)
    try:
        # A short step first: the first step's one-time costs (thread pools, lazily loaded kernels,
        # the optimizer state) are not the step's memory. Its state stays and counts as live.
        trainer.train_step([micro_batch(config, seq_len=min(64, config.training.seq_len))])
        batch = micro_batch(config)
        state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        tensors = [*trainer.pm.inner.parameters(), *trainer.pm.inner.buffers(), *state]
        live = sum(t.numel() * t.element_size() for t in tensors)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident high-water mark (VmHWM) to the current size
        before = _status_bytes("VmRSS")
        trainer.train_step([batch for _ in range(config.training.gradient_accumulation_steps)])
        return _status_bytes("VmHWM") - before, live
    finally:
        trainer.release(0)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"/proc/self/status has no {key}")
