"""A model plait did not write, pipelined: transformers' LlamaForCausalLM cut by module paths
(`ModelParts`, `split_user_model`) with the README's recipe, trained like one process.

The README's "Your own model" block is executed here as written: its `LLAMA_PARTS`,
`llama_context` and `llama_block` drive every case (its `main` runs as printed in
tests/test_combo_readme_blocks.py). The model is transformers' own (a tiny fp32 SDPA LlamaConfig built here, no hub download), never edited.
Cases, three AdamW steps each (the second with explicit, spaced position_ids that must reach every
stage), losses and every parameter within 1e-5 of one process training the whole batch:
- pp2_1f1b: PP 2, 1F1B, 4 micro-batches (2 ranks);
- pp2_interleaved_1f1b: PP 2 x 2 virtual stages, one block each (2 ranks: two stage modules per
  rank keep the same rotary embedding);
- pp2_fsdp2_1f1b: PP 2 x FSDP 2, plait-dataparallel on each stage (4 ranks).
One spawn per world size. plait-dataparallel (the 4-rank case) and transformers are test-only.
"""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.mesh import ParallelDims, build_meshes
from plait.pipelineparallel import (
    PipelineConfigError,
    build_pipeline,
    schedule_style,
    split_user_model,
    validate_pipeline_parallel,
)
from plait.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 4, 4, 2, 256
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-3
# AdamW divides by |gradient| + eps: with torch's default eps = 1e-8 a gradient entry near zero turns
# summation-order noise (~1e-10: micro-batches add up in another order) into parameter differences
# of ~1e-5 (measured: 1 of 4096 entries at 1.1e-5). eps = 1e-6 bounds that gain at LR / EPS.
EPS = 1e-6
TIMEOUT = 240

README = Path(__file__).parents[1] / "README.md"


def _readme_example() -> dict:
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Your own model") :], re.S).group(1)
    namespace = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


RECIPE = _readme_example()


def make_model() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=4 * SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def batch(step: int):
    # The same tokens every step, so that a few steps visibly lower the loss (random tokens would not).
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10))
    # Step 1 passes positions spaced unlike the default arange(S) (RoPE sees differences): a stage
    # that did not get them would attend differently.
    positions = torch.arange(SEQ) * 2 if step == 1 else None
    return tokens[:, :-1], tokens[:, 1:], positions


def summed_ce(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), reduction="sum")


def train_one_process():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        inputs, labels, positions = batch(step)
        position_ids = None if positions is None else positions[None]
        loss = summed_ce(model(input_ids=inputs, position_ids=position_ids).logits, labels) / labels.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_pipelined(meshes, schedule, virtual, n_mb, fsdp=False):
    """STEPS of AdamW on this dp rank's rows; (the losses this rank reports, its stages' full params)."""
    model = make_model()
    pp = meshes.pp_degree
    validate_pipeline_parallel(RECIPE["LLAMA_PARTS"].parallel_info(model), pp, schedule, n_mb, None, virtual)
    stages = split_user_model(
        model, RECIPE["LLAMA_PARTS"], pp, meshes.pp_rank, None, virtual, schedule_style(schedule),
        block_call=RECIPE["llama_block"], context=RECIPE["llama_context"],
    )  # fmt: skip
    if fsdp:
        from plait.dataparallel import DataParallelConfig, apply_data_parallel

        config = DataParallelConfig(reshard_after_forward="never")
        for s in stages:
            apply_data_parallel(s.module, meshes, s.blocks, config, edge_units=s.edge_units)
    pipeline = build_pipeline(stages, meshes.pp.get_group(), schedule, n_mb, summed_ce, "cpu")
    opt = torch.optim.AdamW([p for m in pipeline.modules for p in m.parameters()], lr=LR, eps=EPS)
    dp, rows = meshes.dp_degree, BATCH // meshes.dp_degree
    mine = slice(meshes.dp_rank * rows, (meshes.dp_rank + 1) * rows)
    losses = []
    for step in range(STEPS):
        inputs, labels, positions = batch(step)
        # FSDP averages gradients over dp: scale = dp ranks / global tokens, as the trainer does.
        loss = pipeline.step(inputs[mine], labels[mine], scale=dp / labels.numel(), position_ids=positions)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item() / dp)  # this dp rank's share of the mean
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for m in pipeline.modules
        for n, p in m.named_parameters()
    }
    return losses, params


# name -> (world size, schedule, virtual stages, micro-batches per dp rank, FSDP)
CASES = {
    "pp2_1f1b": (2, "1F1B", 1, 4, False),
    "pp2_interleaved_1f1b": (2, "Interleaved1F1B", 2, 4, False),
    "pp2_fsdp2_1f1b": (4, "1F1B", 1, 4, True),
}


def _on_ranks(rank, world_size, names):
    torch.set_num_threads(1)
    dims = ParallelDims(pp=2, dp_shard=world_size // 2, world_size=world_size)
    out = {}
    for name in names:
        _, schedule, virtual, n_mb, fsdp = CASES[name]
        out[name] = train_pipelined(build_meshes(dims), schedule, virtual, n_mb, fsdp)
    return out


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("world_size", sorted({case[0] for case in CASES.values()}))
def test_transformers_llama_pipelined_matches_one_process(world_size):
    torch.set_num_threads(1)
    ref_losses, ref_params = train_one_process()
    assert ref_losses[-1] < ref_losses[0], ref_losses
    names = [name for name, case in CASES.items() if case[0] == world_size]
    results = run_on_ranks(_on_ranks, world_size, names, timeout=TIMEOUT)
    for name in names:
        # Each dp rank of the last stage reports its share of the global mean loss.
        reported = [r[name][0] for r in results if r[name][0][0] is not None]
        assert len(reported) == world_size // 2, name
        losses = [sum(shares) for shares in zip(*reported)]
        assert losses == pytest.approx(ref_losses, abs=1e-5), (name, losses, ref_losses)
        params = {}
        for r in results:
            params.update(r[name][1])
        assert params.keys() == ref_params.keys(), name
        for pname, ref in ref_params.items():
            where = f"{name} {pname}"
            torch.testing.assert_close(params[pname], ref, atol=1e-5, rtol=1e-5, msg=lambda m, w=where: f"{w}: {m}")


def test_stages_share_the_model_and_partition_its_state_dict():
    """Cut for both ranks of PP 2 x 2 virtual stages: the stages hold the model's own parameters
    under its keys, each exactly once, and run the whole model when chained."""
    model = make_model()
    parts = RECIPE["LLAMA_PARTS"]
    stages = [s for r in range(2) for s in split_user_model(model, parts, 2, r, None, 2, "loop",
              RECIPE["llama_block"], RECIPE["llama_context"])]  # fmt: skip
    stages.sort(key=lambda s: s.index)
    keys = [k for s in stages for k in s.module.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))
    model_params = dict(model.named_parameters())
    assert all(p is model_params[n] for s in stages for n, p in s.module.named_parameters())
    assert [s.edge_units for s in stages] == [[["model.embed_tokens"]], [], [], [["model.norm", "lm_head"]]]
    inputs, _, _ = batch(0)
    hidden = inputs
    with torch.no_grad():
        for s in stages:
            hidden = s.module(hidden)
        torch.testing.assert_close(hidden, model(input_ids=inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"norm": "model.final_norm"}, r"ModelParts.norm = 'model.final_norm' is not a submodule of LlamaForCausalLM"),
        ({"shared": ["model.norm"]}, r"ModelParts.shared names 'model.norm', which has parameters"),
        ({"norm": None}, r"parameter 'model.norm.weight' is in none of the ModelParts"),
        ({"tied": True}, r"ModelParts.head = 'lm_head' shares its weight with the embedding"),
        ({"shared_blocks": True}, r"parameter 'model.layers.0.mlp.up_proj.weight' \(stage 0\) is also "
                                  r"'model.layers.3.mlp.up_proj.weight' on stage 1"),
    ],
)
def test_bad_parts_are_refused_in_one_line(change, match):
    model = make_model()
    if change.pop("tied", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    if change.pop("shared_blocks", False):  # issue 53, item 6: a weight on two stages besides the tie
        model.model.layers[3].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    parts = replace(RECIPE["LLAMA_PARTS"], **change)
    with pytest.raises(PipelineConfigError, match=match):
        split_user_model(model, parts, 2, 0)
