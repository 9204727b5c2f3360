"""The run's data loaders, built from the [data] and [training] sections on this rank's dp share."""

import torch.distributed as dist

from .config import Config, ConfigError
from .fault_tolerance import data_shard
from .validate import RunPlan


def data_exchange():
    """The ranks that tokenise the data between them: every rank of the job, over a gloo group of
    the data's own (tokens are host data; a prefetch thread must not interleave with training's
    collectives). Collective: every rank calls it at the same point."""
    from plait.data.exchange import DistributedExchange, SoloExchange

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return SoloExchange()
    return DistributedExchange(dist.new_group(backend="gloo"))


def build_loader(config: Config, plan: RunPlan, meshes, dataset: str, split: str, accumulation: int, exchange):
    from plait.data import build_dataloader

    t = config.training
    # A replica group trains on its own part of each global batch (fault_tolerance.data_shard) and
    # validates on the same batches as every other group: one val_loss, the same in every group's
    # metrics while their weights agree.
    dp_rank, dp_degree = meshes.dp_rank, meshes.dp_degree
    if split == "train":
        dp_rank, dp_degree = data_shard(config, dp_rank, dp_degree)
    try:
        return build_dataloader(
            dataset=dataset,
            dataset_path=(config.data.dataset_path or None) if dataset == config.data.dataset else None,
            tokenizer=plan.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            gradient_accumulation_steps=accumulation,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            seed=config.job.seed,
            split=split,
            streaming=config.data.streaming,
            text_field=config.data.text_field,
            exchange=exchange,
        )
    except (FileNotFoundError, ValueError, KeyError) as e:
        # Every rank fails the same way here, so no rank is left waiting in a collective.
        raise ConfigError(f"data.dataset = {dataset!r} ({split}): {e}") from None
