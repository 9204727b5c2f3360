"""A plan: validate a config as plait-train does (without data), trace rank 0's step through the
device's kernel routes and report it against the device (`make_plan`); what plait-plan's
command line (cli.py) and the layout search (search.py) both call.
"""

from dataclasses import dataclass

from plait.trainer.config import ConfigError

# The largest world planned. The trace is rank 0's, but the fake world's meshes hold every rank's
# number (torch's DeviceMesh: a rank map and its tuple, about 200 bytes a rank): the Llama 3 debug
# model planned in 5.1 s at 100,000 ranks, 5.4 s / 0.7 GB at 2^20 and 8.3 s / 1.3 GB at 2^22 (one
# thread); 10^9 would need hundreds of GB.
MAX_WORLD_SIZE = 2**20
# Mean document length of a document-masked plan when neither --plan.document_tokens nor the
# configured data (a pre-tokenised folder's meta.json) says.
DEFAULT_DOCUMENT_TOKENS = 2048


@dataclass
class PlanArgs:
    world_size: int | None = None
    device: str = "h100"
    device_memory_gib: float | None = None
    document_tokens: int | None = None
    json: str | None = None
    search: bool = False
    search_limit: int | None = None
    max_batch: bool = False


def check_world_size(world_size: int) -> None:
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"--plan.world_size = {world_size}: plait-plan plans at most {MAX_WORLD_SIZE:,} ranks "
                          "(its fake world holds every rank's mesh coordinates).")


def default_world_size(config) -> int:
    """The product of the configured degrees (dp_shard = -1 counts as 1)."""
    p = config.parallelism
    return max(1, p.dp_replicate) * max(1, p.dp_shard) * p.cp * p.tp * max(1, p.pp)


def documents_per_row(config, model_args, document_tokens: int | None) -> dict:
    """The documents a traced row holds: seq_len / the mean document length (at least one), and
    where that length came from (--plan.document_tokens, the configured data, the default; a
    causal mask sees one document per row)."""
    seq_len = config.training.seq_len
    if document_tokens:
        source = "--plan.document_tokens"
    elif getattr(model_args, "attention_mask", "causal") != "document":
        document_tokens, source = seq_len, "causal mask: one document per row"
    else:
        document_tokens = _data_document_tokens(config)
        source = f"the mean of {config.data.dataset_path} (meta.json)" if document_tokens else (
            "the default (a data set's document lengths are read only from a pre-tokenised folder's meta.json)")
        document_tokens = document_tokens or DEFAULT_DOCUMENT_TOKENS
    per_row = max(1, min(seq_len, round(seq_len / document_tokens)))
    return {"document_tokens": document_tokens, "documents_per_row": per_row, "source": source}


def _data_document_tokens(config) -> int | None:
    """The mean document length of a pre-tokenised folder (its meta.json: cheap); None for any
    other source, or a folder that is not there (a plan reads no data)."""
    from plait.data.sources import TOKENS

    if config.data.dataset != TOKENS or not config.data.dataset_path:
        return None
    try:
        from plait.data.token_format import read_meta

        meta = read_meta(config.data.dataset_path)
        return max(1, round(meta["num_tokens"] / meta["num_documents"]))
    except Exception:  # noqa: BLE001 - any unreadable folder: the default stands in
        return None


def make_plan(config, plan_args: PlanArgs) -> dict:
    """Validate (as plait-train, without data), trace rank 0's step through the device's kernel
    routes, and report against the device."""
    import dataclasses

    from plait.trainer.memory_estimate import estimate_memory
    from plait.trainer.validate import validate

    from .devices import DEVICES
    from .report import build_report
    from .trace import trace_step

    world_size = plan_args.world_size or default_world_size(config)
    check_world_size(world_size)
    plan = validate(config, world_size=world_size, need_data=False)
    documents = documents_per_row(config, plan.model_args, plan_args.document_tokens)
    # Compiled blocks run the same ops; the trace runs them eagerly (no compiler under fake tensors).
    traced_config = dataclasses.replace(config, training=dataclasses.replace(config.training, compile=False))
    traced = trace_step(traced_config, plan, documents_per_row=documents["documents_per_row"], gpu=True)
    device = DEVICES[plan_args.device]
    memory_gib = plan_args.device_memory_gib or device.memory_gib
    analytic = estimate_memory(config, plan.dims, plan.model, plan.info).parts()
    return build_report(config, plan, traced, device, memory_gib, analytic, documents)
