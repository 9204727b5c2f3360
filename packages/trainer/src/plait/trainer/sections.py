"""The sections of a run's configuration, one dataclass each ([job], [comm], [model], [data],
[training], [parallelism], [optimizer], [lr_scheduler], [checkpoint], [metrics], [fault_tolerance]).

Every field is documented by the string literal under it: `plait-train --help` prints those docs
(config.py reads them), so the text under a field is its user-facing documentation.
"""

from dataclasses import dataclass, field, fields
from typing import Literal


@dataclass
class JobConfig:
    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl, tensorboard events (tb/), profiler traces and checkpoints. One run
    at a time: a run holds <dump_folder>/.plait-run.lock (pid and host) while it trains."""
    seed: int = 0
    """Seed of the initial weights and the data order; the same seed gives the same run on any layout."""
    description: str = ""
    """Free text, printed at start-up."""
    stop_grace_s: int = 300
    """On SIGTERM, seconds `plait-train --nproc-per-node` gives its ranks to finish the step and save
    a checkpoint before it SIGKILLs them (torch elastic's shutdown timeout; under torchrun pass
    --shutdown-timeout). Send the signal at least this long before a scheduler's hard limit."""
    rank_start: Literal["auto", "fork", "spawn"] = "auto"
    """How `plait-train --nproc-per-node` starts its ranks. fork: from a process that has imported
    torch and the trainer once (a spawned rank spends ~15 s of CPU on those imports, every rank at
    once); spawn: `python -m plait.trainer` per rank, as torchrun does. auto: fork where torch has
    no CUDA build, else spawn (a process forked after CUDA's driver started cannot use it)."""
    collective_timeout_s: float = 600.0
    """Seconds a collective waits for a rank that does not join (a stalled or stopped process, a
    lost node) before it fails (exit 74, naming the rank it waited on: see heartbeat.py). Large
    enough for the slowest checkpoint load or compile of a step; lower it to fail a hang sooner."""


@dataclass
class CommConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend. auto: nccl where each local rank has a GPU of its own, gloo on CPU. nccl:
    as auto, refused without CUDA. gloo: on a CUDA machine local rank r computes on cuda:(r % GPUs),
    so several ranks may share one GPU (NCCL refuses that), with collectives on CUDA tensors through
    gloo and host memory: slow, for testing every layout on one GPU; point-to-point is staged by
    plait-mesh. More local ranks than GPUs is refused under auto and nccl."""


@dataclass
class ModelConfig:
    name: Literal["llama3", "deepseek_v3", "qwen3"] = "llama3"
    """Model family in the plait.models registry."""
    flavor: str = "debugmodel"
    """Size within the family: llama3 debugmodel, 1B, 3B, 8B, 70B, 405B; deepseek_v3 debugmodel, 16B, 236B, 671B,
    kimi_k2; qwen3 debugmodel, debugmodel_moe, 0.6B, 1.7B, 4B, 8B, 14B, 32B, 30B-A3B, 235B-A22B."""
    tokenizer_path: str = ""
    """Tokenizer file, chosen by what it is: a Hugging Face `tokenizer.json` (or a folder with one; BOS/EOS
    from the `tokenizer_config.json` beside it) through `tokenizers`, else a tiktoken BPE `tokenizer.model`;
    empty means the small BPE shipped with plait-trainer."""
    init: Literal["auto", "full", "sharded"] = "auto"
    """Weight init. full: every rank materialises the whole model and runs init_weights from job.seed
    before any sharding, so the initial weights are identical on every layout (parity from step 1).
    sharded: materialise only the local shards and init them (needed when the full model does not
    fit one device; DTensor random init, bitwise parity with 1 rank not promised on CPU). auto: full
    when the fp32 model takes under 8 GiB, else sharded."""
    args: dict = field(default_factory=dict)
    """Overrides of the flavor's model arguments: every other [model] key / --model.<field> (e.g.
    max_seq_len, n_layers, aux_loss_coeff), checked against the flavor's ModelArgs."""


@dataclass
class DataConfig:
    dataset: str = "builtin"
    """Training dataset: "builtin" (the small corpus shipped with plait-trainer), a local format
    (json, parquet, text, csv, arrow) read from dataset_path, a local path, a hub alias (c4,
    fineweb, fineweb-edu) or a Hugging Face id "owner/name[:config]" (see plait.data)."""
    dataset_path: str = ""
    """Local file, glob or folder to read the dataset from (local formats, or a local copy of a
    hub dataset)."""
    text_field: str = "text"
    """Column of the dataset that holds the text."""
    streaming: bool = False
    """Stream the dataset instead of downloading it first (Hugging Face datasets)."""
    val_dataset: str = ""
    """Validation dataset (same forms as dataset, read with split "validation"; dataset_path is
    used when it names the same dataset); empty disables validation."""
    val_interval: int = 0
    """Run validation every this many steps (0: never)."""
    val_steps: int = 10
    """Batches per validation run."""
    prefetch: int = 1
    """Training batches prepared ahead in a background thread while the step runs (0: prepared in
    the step, synchronously; at most 16, each is held in memory). Resume is exact either way."""


@dataclass
class TrainingConfig:
    steps: int = 60
    """Optimizer steps to run."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank. Global batch = local_batch_size x
    gradient_accumulation_steps x data-parallel degree."""
    seq_len: int = 256
    """Tokens per sequence; at most the model's max_seq_len."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; each micro-batch's summed token loss is scaled by the
    data-parallel ranks over the global batch's count of valid tokens, so the step's gradient is the
    mean over every valid token of the global batch however it is split."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. bfloat16: FSDP/TP runs cast parameters by the sharding policy (fp32 master
    weights, fp32 gradient reduction); a single process uses autocast."""
    cpu_bf16: Literal["auto", "native", "fp32"] = "auto"
    """On a CPU, the kernels of bf16 products and attention: auto, fp32 kernels on the bf16 operands
    where this CPU emulates bf16 (no AVX512-BF16 / AMX / ARM BF16: 3-5x faster there; attention at
    head dim <= 16 on every CPU), torch's bf16 kernels elsewhere; native, torch's bf16 kernels always
    (equal work with another framework's bf16 run); fp32, fp32 kernels always. No effect on a GPU.
    plait.models.cpu_bf16 decides; context parallel takes its answer."""
    float8: Literal["off", "tensorwise", "rowwise"] = "off"
    """Float8 compute for the model's linear layers (torchao's Float8Linear: pip install
    'plait-trainer[float8]'; needs training.dtype = bfloat16). tensorwise: one scale per tensor;
    under FSDP / HSDP the weights are all-gathered in float8, their scales computed once per step
    after the optimizer. rowwise: one scale per row, more accurate, weights gathered in bf16. The
    output layer and layers float8_filter excludes stay in bf16; weights, gradients, optimizer
    state and checkpoints stay in high precision (resume with float8 on or off)."""
    float8_filter: Literal["auto", "divisible"] = "auto"
    """Which linears float8 converts. auto: torchao's rule, skipping layers too small to gain on a
    GPU (and any whose dims are not multiples of 16); divisible: every linear whose dims are
    multiples of 16 (small models, tests)."""
    float8_experts: Literal["off", "auto", "rowwise", "mxfp8"] = "off"
    """Float8 compute for the routed experts' grouped GEMMs (torchao; needs training.dtype =
    bfloat16). rowwise: one scale per row (CUDA sm89+, H100), expert groups padded to 16 rows;
    mxfp8: one scale per 32 elements (CUDA sm100, B200; torchao's emulation on a CPU), groups
    padded to 32 rows; auto: mxfp8 on sm100 and CPUs, rowwise on sm89 / sm90. Independent of
    training.float8 (the linears). Weights and checkpoints stay in high precision."""
    loss: Literal["chunked", "full"] = "full"
    """The token cross-entropy. full: the output layer's logits [tokens, vocab], then the loss on
    their fp32 upcast. chunked: the output layer and the loss in one function over chunks of
    loss_chunk_tokens tokens (plait/trainer/chunked_loss.py): no logits kept for backward, which
    recomputes each chunk's, so at most one chunk of logits is alive; under tensor parallel the
    chunks are vocab-sharded (one all-gather per chunk; parallelism.loss_parallel only applies to
    full). The same loss within float tolerance; a model without an `output` linear needs full."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of training.loss = chunked. 0: sized from the vocabulary, the largest power
    of two whose fp32 logits take at most 2^26 elements (256 MiB): 512 tokens at a 128k vocabulary."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) and deterministic kernels: bitwise-repeatable runs."""
    compile: bool = False
    """torch.compile each block (needs a C++ compiler on CPU, triton on GPU)."""
    compile_mode: Literal["default", "reduce-overhead"] = "default"
    """torch.compile's mode for the blocks. reduce-overhead: CUDA graphs (torch's cudagraph trees)
    replay each compiled block's kernels from one launch on GPU. Needs a block with no host sync
    and no data-dependent shape (dense models; MoE in expert capacity mode, not dropless expert
    parallel) and parameters at fixed addresses (no FSDP / HSDP: they free and re-allocate the
    unsharded parameters every step). On CPU it is the default mode (no CUDA graphs)."""
    compile_comm_overlap: bool = True
    """compile_mode = default: inductor moves independent compute between each collective inside a
    compiled block (expert parallel's all-to-alls, tensor parallel's collectives) and its wait
    (reorder_for_compute_comm_overlap). The same ops, reordered."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward. full: keep only block inputs. selective: op-level, keep
    matmul and attention outputs, recompute the rest (norms, activations, RoPE)."""
    activation_checkpoint_every: int = 1
    """Apply the activation_checkpoint policy to every k-th block only (blocks 0, k, 2k, ...)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is still logged)."""
    memory_check: bool = True
    """Before step 1, refuse a run whose estimated per-rank peak memory (model state, FSDP's
    unsharded units, activations, logits; plait/trainer/memory_estimate.py) exceeds the GPU's memory
    (on CPU: the available host memory / ranks on the node). The estimate errs low; false skips it."""


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    """Replicated data-parallel degree (DDP / HSDP's replicate axis)."""
    dp_shard: int = -1
    """Sharded data-parallel degree (FSDP); -1 infers it as world_size / (dp_replicate * cp * tp)."""
    pp: int = 1
    """Pipeline-parallel degree, the outermost mesh axis (needs plait-pipelineparallel): the model is
    cut into stages at block boundaries, the embedding on the first, norm + output head on the last."""
    pipeline_schedule: str = "1F1B"
    """Under pp > 1, torch's schedule by name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (case-insensitive)."""
    pipeline_microbatch_size: int = 1
    """Under pp > 1, rows per pipeline micro-batch; it must divide local_batch_size x
    gradient_accumulation_steps (the accumulation micro-batches run as one pipelined batch).
    1 gives the most micro-batches, so the smallest bubble; raise it for larger matmuls."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Under pp > 1, blocks per stage in order (pp x pipeline_virtual_stages entries, e.g. [3, 5, 5, 3]
    to balance the embedding and the head); empty splits the blocks evenly."""
    pipeline_virtual_stages: int = 1
    """Under pp > 1, stages per rank: 1 for GPipe / 1F1B, 2+ for the interleaved schedules, exactly 2
    for the V schedules (ZBVZeroBubble, DualPipeV)."""
    cp: int = 1
    """Context-parallel degree (needs plait-contextparallel)."""
    cp_method: Literal["allgather", "ring", "ulysses"] = "allgather"
    """Context-parallel attention: allgather (gather K/V once per layer), ring (K/V blocks passed
    around the cp ranks, overlapped with attention, memory O(seq_len / cp)), or ulysses (all-to-all
    from sequence to head shards; heads / tp must be divisible by cp)."""
    cp_load_balance: bool = True
    """Under CP, shard each sequence head-tail (rank r holds chunks r and 2cp-1-r of 2cp) so every
    rank does the same causal attention work; false: contiguous shards."""
    cp_load_balance_rounds: int = 1
    """Head-tail sharding repeated in this many rounds (2 x cp x rounds chunks; rank r takes chunks r
    and 2cp-1-r of every round). Causal work is balanced at 1; under model.attention_mask = "document"
    with documents short relative to seq_len / cp, 2-4 rounds cut the per-rank work imbalance (web
    text at seq 16K, 8 rows: max/mean 1.11-1.24 at 1 round, 1.03-1.06 at 4) for more, smaller kernel
    calls; keep seq_len / (2 cp rounds) at a few hundred tokens or more."""
    tp: int = 1
    """Tensor-parallel degree (needs plait-tensorparallel)."""
    sequence_parallel: bool = True
    """Under TP, shard norms and residuals on the sequence dimension."""
    loss_parallel: bool = True
    """Under TP, compute the loss on vocabulary-sharded logits without gathering them."""
    async_tp: bool = False
    """Overlap TP collectives with matmuls (symmetric memory, CUDA only)."""
    ep: int = 1
    """Expert-parallel degree for MoE models, borrowed from dp_shard x cp (needs plait-expertparallel)."""
    etp: int = 1
    """Expert tensor-parallel degree: 1 or tp."""
    expert_capacity_factor: float = 0.0
    """Expert parallel dispatch: 0 = dropless (uneven all-to-all, one host sync per MoE layer); > 0 =
    capacity mode, each (rank, expert) pair sends at most factor x its even share of tokens through
    a static all-to-all with no host sync; tokens beyond it are dropped (counted at the end)."""
    replicate_impl: Literal["fsdp", "ddp"] = "fsdp"
    """How dp_replicate is done without sharding: FSDP-based replicate or DDP."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP: free gathered parameters after forward (always), keep them for backward (never), or
    plait.dataparallel's choice (default)."""
    fsdp_prefetch: Literal["auto", "explicit", "implicit"] = "auto"
    """FSDP: issue the next block's all-gathers (in backward the previous block's) one block early
    (explicit), or leave it to FSDP's implicit prefetching, which overlaps them only while the host
    runs ahead of the device (implicit). auto: explicit under expert parallel, whose dropless
    dispatch syncs the host once per MoE layer and so stops it running ahead, and on CPU, which has
    no streams to prefetch implicitly; implicit otherwise."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = 2e-3
    """Peak learning rate (after warmup)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW), applied to every parameter."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    implementation: Literal["auto", "fused", "foreach"] = "auto"
    """Kernel: fused (one kernel for all parameters), foreach (multi-tensor), or auto (fused
    where the device supports it, else foreach)."""
    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """AdamW's two moments: fp32 (torch's AdamW, 16 bytes of model state per parameter with the
    fp32 weight and gradient), bf16 (12 bytes: plait's AdamW with bf16 moments, fp32 arithmetic and
    stochastic rounding whose random bits depend on each element's place in its parameter, so
    every layout equals one rank; `implementation` does not apply), or int8 (refused: see
    optimizer.py). A checkpoint resumes under another of fp32 / bf16 (the moments are converted)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 6
    """Steps of linear warmup from lr/warmup_steps to lr."""
    decay: Literal["linear", "cosine", "wsd", "none"] = "linear"
    """After warmup: linear or cosine decay to lr * min_lr_ratio over the remaining steps; wsd holds
    lr, then decays linearly over the last decay_ratio of the steps after warmup; none holds lr."""
    decay_ratio: float = 0.2
    """wsd only: fraction of the post-warmup steps spent decaying."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr."""


@dataclass
class CheckpointConfig:
    enable: bool = False
    """Save distributed checkpoints (torch DCP: model, optimizer, LR schedule, data position, RNG,
    step) every `interval` steps, at the end and on SIGTERM, and resume from the newest complete
    one in `folder` when the run starts."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to job.dump_folder (or absolute). Holds step-NNNNNN/ folders."""
    interval: int = 0
    """With enable: save every this many steps (0: only at the end of training)."""
    keep_last: int = 0
    """Keep only this many most recent checkpoints (0: keep all)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: copy the state to CPU memory and write it from a background thread while training
    goes on (dcp.async_save on its own gloo group; one save in flight, the final save is synchronous)."""
    load_step: int = -1
    """Resume from step-<load_step> (-1: the newest complete checkpoint, skipping incomplete ones
    with a warning). A requested checkpoint that is missing or incomplete is an error."""
    allow_fresh_start: bool = False
    """With enable: when `folder` holds checkpoints but none of them can be resumed (all damaged),
    train from step 1 anyway instead of stopping with an error. The damaged checkpoints are kept
    (renamed step-N.rejected-<run id> when this run saves the same step) and metrics.jsonl is kept
    as metrics.jsonl.replaced-<run id>."""
    create_seed_checkpoint: bool = False
    """Initialise the model on one process, save it (model only) as <folder>/step-000000 and exit.
    Runs on any layout then start from those weights (auto-resume, or initial_load_path)."""
    initial_load_path: str = ""
    """A new run (nothing to resume in folder) starts from these weights: a checkpoint folder (model
    only; training starts at step 1), or a Hugging Face folder with initial_load_hf."""
    initial_load_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json + safetensors), read through the
    model's plait.models HF adapter."""
    last_save_in_hf: bool = False
    """At the end of training also export the model as Hugging Face safetensors (export_dtype)
    to <folder>/hf-step-NNNNNN."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """dtype of Hugging Face exports (last_save_in_hf)."""


@dataclass
class MetricsConfig:
    log_freq: int = 10
    """Print/log every this many steps, and the first step a run (or a resume) trains: the only
    steps that synchronise with the host."""
    tensorboard: bool = True
    """Write tensorboard events under <dump_folder>/tb (rank 0)."""
    wandb: bool = False
    """Also log the tensorboard scalars to Weights & Biases (rank 0), with this configuration as the
    run's config; needs `pip install plait-trainer[wandb]`. Its files go under <dump_folder>/wandb
    unless WANDB_DIR is set; WANDB_MODE=offline logs without a server."""
    wandb_project: str = ""
    """W&B project ("": WANDB_PROJECT, else wandb's default)."""
    wandb_entity: str = ""
    """W&B entity, a user or team ("": WANDB_ENTITY, else the logged-in user's default)."""
    wandb_run_name: str = ""
    """W&B run name ("": WANDB_NAME, else a generated name)."""
    profile_interval: int = 0
    """Write a torch profiler trace of one step every this many steps under <dump_folder>/profile
    (0: off)."""
    cpu_peak_tflops: float = 0.0
    """Peak TFLOP/s of one rank on CPU, for MFU; 0 measures a matmul once at start-up."""
    progress_bar: bool = True
    """Show a tqdm progress bar (rank 0)."""


@dataclass
class FaultToleranceConfig:
    enable: bool = False
    """Train as one replica group of several (torchft, `pip install 'plait-trainer[faulttolerance]'`):
    each group is its own plait-train / torchrun job with its own layout inside; the gradient
    average across groups goes through torchft, every group steps only when all in the quorum
    committed, a lost group is dropped without stopping the others, and a (re)joining group gets
    the live state from a peer. Each group writes under <dump_folder>/replica_<replica_id>;
    replica 0 writes the checkpoints."""
    replica_id: int = 0
    """This group's index, 0 .. group_size - 1: it trains on that part of each global batch (and
    validates on the same batches as every other group, so their val_loss agree)."""
    group_size: int = 1
    """The number of replica groups the data is split over (the replicate degree across groups)."""
    lighthouse: str = ""
    """The torchft lighthouse's address (http://host:port); "": the TORCHFT_LIGHTHOUSE variable."""
    min_replicas: int = 1
    """The fewest groups a step may run with; a group that waits longer than quorum_timeout_s for
    them exits 74 (infrastructure fault)."""
    quorum_timeout_s: float = 60.0
    """Seconds a group waits for a quorum (and a peer's state when it joins) before it exits 74."""
    semi_sync: Literal["none", "local_sgd", "diloco"] = "none"
    """none: the gradients are averaged across groups every step. local_sgd: each group steps on
    its own and the parameters are averaged every sync_steps. diloco: the same, with an outer
    Nesterov SGD step on the averaged difference (DiLoCo)."""
    sync_steps: int = 20
    """Steps between the groups' synchronisations under semi_sync."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)


SECTIONS: dict[str, type] = {f.name: f.type for f in fields(Config)}
