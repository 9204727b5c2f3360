"""What context parallel is asked to do, and every check made before the first collective."""

from dataclasses import dataclass

from plait.mesh import ParallelConfigError

METHODS = ("allgather", "ring", "ulysses")
ATTENTION_MASKS = ("causal", "document")
"""What every method honours: "document" needs nothing more than the rows' document_positions,
handed to the attention modules as their 4th argument (full rows, the same on every cp rank)."""


@dataclass(frozen=True)
class ContextParallelConfig:
    method: str = "allgather"
    """allgather: gather K/V once per layer (default). ring: pass K/V blocks around the cp ranks,
    overlapped with attention, memory O(S / cp). ulysses: all-to-all sequence shards to head shards."""
    load_balance: bool = True
    """Head-tail (zigzag) sharding: rank r holds chunks r and 2cp-1-r of 2cp, so causal work is even."""
    load_balance_rounds: int = 1
    """Head-tail rounds (the trainer's `parallelism.cp_load_balance_rounds`): the sequence is cut into
    2 x cp x rounds chunks and every round j (chunks [2cp j, 2cp (j + 1))) is dealt head-tail, rank r
    taking its chunks r and 2cp-1-r. Causal work is exactly balanced for any value; raise it (2-4)
    for document masking when documents are short relative to seq_len / cp: on a web-like mix one
    round leaves max/mean work 1.07-1.24 on 8-row micro-batches (cp 2-8), 4 rounds 1.01-1.06 (README
    table). It costs more, smaller kernel calls (at most 2 per chunk a rank holds) and needs seq_len divisible
    by 2 x cp x rounds. Contiguous sharding (load_balance=False) gives each rank 2 x rounds
    consecutive chunks: the same tokens and kernel calls as one round."""
    cpu_half_in_fp32: bool = False
    """On the CPU, run fp16 / bf16 attention blocks through the flash kernel in fp32 (faster where the
    CPU emulates bf16). The caller decides, as its models do (the trainer passes
    plait.models.cpu_bf16.cpu_attends_in_fp32 for the model's head dim); context parallel probes
    nothing. Ignored on GPU."""


def validate_context_parallel(
    info: dict, cp: int, seq_len: int, config: ContextParallelConfig, tp: int = 1, attention_mask: str = "causal"
) -> None:
    """Check a model's metadata and the run against context parallel; raise ParallelConfigError.

    `attention_mask` is the model's (`model.attention_mask`): every method honours "causal" and
    "document". Local and identical on every rank: call it before any collective.
    """
    if attention_mask not in ATTENTION_MASKS:
        raise ParallelConfigError(
            f"model.attention_mask = {attention_mask!r}: context parallel (every cp_method) computes "
            f"{' or '.join(repr(m) for m in ATTENTION_MASKS)} attention; set model.attention_mask to one of them."
        )
    if config.method not in METHODS:
        raise ParallelConfigError(
            f"parallelism.cp_method = {config.method!r}: use one of {', '.join(METHODS)}."
        )
    if cp < 1:
        raise ParallelConfigError(f"parallelism.cp = {cp}: must be >= 1.")
    if not info.get("attention_modules"):
        raise ParallelConfigError(
            "context parallel needs the attention contract: the model's parallel_info() lists no "
            "attention_modules (replaceable sdpa submodules, docs/contracts.md); set parallelism.cp = 1."
        )
    rounds = config.load_balance_rounds
    if not isinstance(rounds, int) or rounds < 1:
        raise ParallelConfigError(
            f"parallelism.cp_load_balance_rounds = {rounds!r}: must be an integer >= 1 (1 = one head-tail "
            f"round of 2 x cp chunks); set it to 1, or 2-4 for document masking with short documents."
        )
    if rounds == 1 and seq_len % (2 * cp):
        raise ParallelConfigError(
            f"training.seq_len = {seq_len} is not divisible by 2 x parallelism.cp = {2 * cp} (context parallel "
            f"cuts each sequence into 2 x cp chunks): use a seq_len that is a multiple of {2 * cp}."
        )
    if seq_len % (2 * cp * rounds):
        raise ParallelConfigError(
            f"training.seq_len = {seq_len} is not divisible by 2 x parallelism.cp x parallelism.cp_load_balance_rounds "
            f"= 2 x {cp} x {rounds} = {2 * cp * rounds} (context parallel cuts each sequence into that many chunks): "
            f"use a seq_len that is a multiple of {2 * cp * rounds}, or fewer cp_load_balance_rounds."
        )
    if config.method == "ulysses":
        heads = info.get("attention_heads", {}).get("n_heads")
        if heads is None:
            raise ParallelConfigError(
                "parallelism.cp_method = 'ulysses' needs the model's head count (parallel_info()"
                "['attention_heads']); use cp_method = 'allgather' or 'ring'."
            )
        if heads % (tp * cp):
            raise ParallelConfigError(
                f"parallelism.cp_method = 'ulysses' splits the {heads} attention heads over tp x cp = {tp * cp} "
                f"ranks, which does not divide them: use cp_method = 'ring' or 'allgather', or tp x cp dividing {heads}."
            )
