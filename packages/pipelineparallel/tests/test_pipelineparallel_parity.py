"""Every schedule reproduces one process running the whole model: losses and every gradient.

The plait Llama 3 debug model (2 or 4 layers, document masking on, some labels ignored) is split
into stages; each rank holds its stages' copies, runs torch's schedule, and compares, three steps
in a row (plain SGD and a validation `eval_step` in between), the loss on the last stage and the
gradient of every parameter it holds with a whole-model reference computed in the same process on
the same batch with the same normalisation (summed token loss / valid tokens). The parent checks
that the ranks together covered every parameter of the model. One 2-rank spawn serves every
schedule in turn, and the aux-loss cases (a loss term each block ties into its own output, as
plait.models' MoE routers do, against one process adding it to the loss); one 4-rank spawn serves
PP 2 x FSDP 2 and PP 4.

The third step runs under the step sentinel with the document segments read on the host before
it (as the trainer does): no host sync at all, so the segments followed the rows into every
micro-batch on every stage and torch's schedules add none once started (their first step, and the
first after an eval_step, do: shape inference sends shapes as Python objects).

plait.models is a test-only dependency: the package itself never imports it.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

models = pytest.importorskip("plait.models.llama3", reason="the parity tests run the plait Llama 3 model")

from plait.mesh import ParallelDims, build_meshes  # noqa: E402
from plait.pipelineparallel import (  # noqa: E402
    build_pipeline,
    schedule_style,
    split_stages,
    validate_pipeline_parallel,
)
from plait.testing import run_on_ranks  # noqa: E402
from plait.testing.sentinel import StepSentinel  # noqa: E402

BATCH, SEQ, STEPS, LR = 4, 16, 3, 0.5
IGNORE = -100

# name -> (schedule, n_layers, virtual stages, layers_per_stage, micro-batches)
CASES = {
    "gpipe": ("GPipe", 2, 1, None, 2),
    "1f1b": ("1F1B", 2, 1, None, 4),
    "1f1b_uneven": ("1F1B", 4, 1, [1, 3], 2),
    "interleaved_1f1b": ("Interleaved1F1B", 4, 2, None, 4),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", 4, 2, None, 4),
    "zbv_zero_bubble": ("ZBVZeroBubble", 4, 2, None, 4),
    "dualpipev_edge_only_stages": ("DualPipeV", 4, 2, [0, 2, 2, 0], 4),
    "looped_bfs": ("LoopedBFS", 4, 2, None, 2),
}


def _model(n_layers: int):
    args = copy.deepcopy(models.FLAVORS["debugmodel"])
    args.n_layers, args.max_seq_len, args.attention_mask = n_layers, 2 * SEQ, "document"
    torch.manual_seed(0)
    model = models.Transformer(args)
    model.init_weights()
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    labels[labels % 7 == 0] = IGNORE  # ignored labels: the normaliser is the valid count, not B x S
    # Documents: each row cut at two random places; offsets restart at 0 at every document start.
    document_positions = torch.empty(BATCH, SEQ, dtype=torch.int32)
    for row in range(BATCH):
        cuts = sorted(torch.randint(1, SEQ, (2,), generator=g).tolist())
        start = 0
        for end in cuts + [SEQ]:
            document_positions[row, start:end] = torch.arange(end - start, dtype=torch.int32)
            start = end
    return inputs, labels, document_positions


def _summed_loss(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=IGNORE, reduction="sum")


def _sgd(params):
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
            p.grad = None


def _run_case(rank, meshes, schedule, n_layers, virtual, layers_per_stage, n_mb):
    reference = _model(n_layers)
    info = reference.parallel_info()
    pp = meshes.pp_degree
    validate_pipeline_parallel(info, pp, schedule, n_mb, layers_per_stage, virtual)
    stages = split_stages(
        reference, info, pp, meshes.pp_rank, layers_per_stage, virtual, schedule_style(schedule)
    )
    pipeline = build_pipeline(stages, meshes.pp.get_group(), schedule, n_mb, _summed_loss, "cpu")
    ref_params = dict(reference.named_parameters())
    checked, losses = set(), []
    sentinel = StepSentinel()
    from plait.models.documents import row_segments
    for step in range(STEPS):
        inputs, labels, document_positions = _batch(step)
        scale = 1.0 / (labels != IGNORE).sum().float()
        # The second step passes explicit [S] positions, spaced unlike the default arange(S) (RoPE
        # only sees differences): a stage that did not get them would attend differently.
        positions = torch.arange(SEQ) * 2 if step == 1 else None
        ref_logits = reference(inputs, positions=positions, document_positions=document_positions)
        ref_loss = _summed_loss(ref_logits, labels) * scale
        ref_loss.backward()
        if step == 2:
            row_segments(document_positions)  # read on the host and cached on the tensor, as the trainer does
            with sentinel:
                loss = pipeline.step(inputs, labels, scale=scale, positions=positions, document_positions=document_positions)
            assert sentinel.step_counts() == [(0, 0)], f"{schedule}: {sentinel.report()}"
        else:
            loss = pipeline.step(inputs, labels, scale=scale, positions=positions, document_positions=document_positions)
        assert (loss is not None) == pipeline.has_last_stage
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
            losses.append(loss.item())
        for stage in stages:
            for name, p in stage.module.named_parameters():
                assert p.grad is not None, (schedule, stage.index, name)
                torch.testing.assert_close(
                    p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5,
                    msg=lambda m, name=name, step=step: f"{schedule} step {step} {name}: {m}",
                )
                checked.add(name)
        _sgd(ref_params.values())
        _sgd([p for stage in stages for p in stage.module.parameters()])
        if step == 0:
            _check_eval_step(pipeline, stages, reference)
    return {
        "stages": [s.index for s in stages],
        "blocks": {s.index: s.blocks for s in stages},
        "checked": sorted(checked),
        "all": sorted(ref_params),
        "losses": losses,
    }


def _check_eval_step(pipeline, stages, reference):
    """Validation between two training steps: forward only, the same summed-and-scaled loss, no
    gradient made (the next training step's parity shows it left the schedule intact)."""
    inputs, labels, document_positions = _batch(STEPS)
    scale = 1.0 / (labels != IGNORE).sum().float()
    with torch.no_grad():
        ref_val = _summed_loss(reference(inputs, document_positions=document_positions), labels) * scale
    val = pipeline.eval_step(inputs, labels, scale=scale, document_positions=document_positions)
    assert (val is not None) == pipeline.has_last_stage
    if val is not None:
        torch.testing.assert_close(val, ref_val, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for stage in stages for p in stage.module.parameters())


# A loss term each block makes (like MoE balance losses), tied into the block's own output so that
# it trains in the block's backward (what plait.models' routers do); the reference adds it to the
# loss. name -> (schedule, n_layers, virtual, micro-batches)
AUX_CASES = {
    "aux_gpipe": ("GPipe", 2, 1, 2),
    "aux_1f1b": ("1F1B", 4, 1, 4),
    "aux_zbv_zero_bubble": ("ZBVZeroBubble", 4, 2, 4),
}
AUX_COEFF = 0.3


def _block_aux(output):
    return (output.float() ** 2).mean() * AUX_COEFF


class _TieAux(torch.autograd.Function):
    """Identity on `y`; in its backward `aux` gets the gradient `weight` (as plait.models' routers)."""

    @staticmethod
    def forward(ctx, y, aux, weight):
        ctx.weight = weight
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, torch.tensor(ctx.weight), None


def _store_block_aux(block, args, output):
    block.aux = _block_aux(output)


def _collect_aux(module):
    return torch.stack([layer.__dict__.pop("aux") for layer in module.layers.values()]).sum()


def _aux_case(meshes, schedule, n_layers, virtual, n_mb):
    reference = _model(n_layers)
    stages = split_stages(reference, reference.parallel_info(), 2, meshes.pp_rank, None, virtual,
                          schedule_style(schedule))
    for stage in stages:  # each micro-batch's term, averaged like the accumulation's
        for layer in stage.module.layers.values():
            layer.register_forward_hook(lambda block, args, out: _TieAux.apply(out, _block_aux(out), 1 / n_mb))
    for layer in reference.layers.values():
        layer.register_forward_hook(_store_block_aux)
    pipeline = build_pipeline(stages, meshes.pp.get_group(), schedule, n_mb, _summed_loss, "cpu")
    inputs, labels, documents = _batch(0)
    scale = 1.0 / (labels != IGNORE).sum().float()
    # The reference accumulates over the same micro-batches: the aux term is per micro-batch.
    for rows in torch.arange(BATCH).tensor_split(n_mb):
        logits = reference(inputs[rows], document_positions=documents[rows])
        (_summed_loss(logits, labels[rows]) * scale + _collect_aux(reference) / n_mb).backward()
    pipeline.step(inputs, labels, scale=scale, document_positions=documents)
    ref_params = dict(reference.named_parameters())
    checked = []
    for stage in stages:
        for name, p in stage.module.named_parameters():
            torch.testing.assert_close(
                p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5,
                msg=lambda m, name=name: f"{schedule} with aux loss {name}: {m}",
            )
            checked.append(name)
    return checked


def _parity_on_ranks(rank, world_size, cases, aux_cases):
    meshes = build_meshes(ParallelDims(pp=world_size, dp_shard=1, world_size=world_size))
    out = {name: _run_case(rank, meshes, *case) for name, case in cases.items()}
    out.update({name: _aux_case(meshes, *case) for name, case in aux_cases.items()})
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_parity_on_ranks, 2, CASES, AUX_CASES, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_one_process(results, name):
    schedule, n_layers, virtual, layers_per_stage, _ = CASES[name]
    per_rank = [r[name] for r in results]
    # Together the two ranks checked every parameter of the model (each rank asserted its own).
    assert set().union(*(r["checked"] for r in per_rank)) == set(per_rank[0]["all"])
    # Exactly one rank holds the last stage and reported a loss per step.
    assert sum(len(r["losses"]) for r in per_rank) == STEPS
    held = sorted(i for r in per_rank for i in r["stages"])
    assert held == list(range(2 * virtual))
    if schedule_style(schedule) == "v":
        assert per_rank[0]["stages"] == [0, 3] and per_rank[1]["stages"] == [1, 2]
    elif virtual == 2:
        assert per_rank[0]["stages"] == [0, 2] and per_rank[1]["stages"] == [1, 3]
    blocks = {i: b for r in per_rank for i, b in r["blocks"].items()}
    counts = layers_per_stage or [n_layers // (2 * virtual)] * (2 * virtual)
    assert [len(blocks[i]) for i in range(2 * virtual)] == counts


@pytest.mark.parametrize("name", list(AUX_CASES))
def test_stage_aux_losses_reach_their_gradients(results, name):
    """Each rank asserted its gradients with the aux term; together they covered every parameter."""
    checked = set(results[0][name]) | set(results[1][name])
    assert checked == set(dict(_model(AUX_CASES[name][1]).named_parameters()))


def test_meta_stages_materialise_and_partition_the_state_dict():
    """The trainer's path: build on meta, split, then to_empty + init_weights per stage."""
    args = copy.deepcopy(models.FLAVORS["debugmodel"])
    args.n_layers = 4
    with torch.device("meta"):
        model = models.Transformer(args)
    info = model.parallel_info()
    stages = [s for r in range(2) for s in split_stages(model, info, 2, r, [1, 1, 1, 1], 2, "v")]
    keys = []
    for stage in stages:
        stage.module.to_empty(device="cpu")
        stage.module.init_weights()
        assert not any(p.is_meta for p in stage.module.parameters())
        assert not stage.module.rope_cos.is_meta  # root buffers live on every stage
        keys += list(stage.module.state_dict())
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))


# PP 2 x FSDP 2 (torch's fully_shard on each stage's blocks and root, as plait-dataparallel does):
# name -> (schedule, n_layers, virtual stages, layers_per_stage, micro-batches)
FSDP_CASES = {
    "1f1b": ("1F1B", 2, 1, None, 2),
    "interleaved_1f1b": ("Interleaved1F1B", 4, 2, None, 2),
    "zbv_zero_bubble": ("ZBVZeroBubble", 4, 2, None, 4),
}


def _fsdp_case(meshes, schedule, n_layers, virtual, layers_per_stage, n_mb):
    from torch.distributed.fsdp import fully_shard

    from plait.mesh import clip_grad_norm_

    reference = _model(n_layers)
    stages = split_stages(
        reference, reference.parallel_info(), 2, meshes.pp_rank, layers_per_stage, virtual, schedule_style(schedule)
    )
    for stage in stages:
        # Under PP the stage keeps its parameters gathered from forward to backward: the zero-bubble
        # schedules' split backward (input grads, later weight grads) loses weight gradients in
        # torch 2.13 when FSDP reshards after forward.
        for block in stage.blocks:
            fully_shard(stage.module.get_submodule(block), mesh=meshes.dp_shard_cp, reshard_after_forward=False)
        fully_shard(stage.module, mesh=meshes.dp_shard_cp, reshard_after_forward=False)
    pipeline = build_pipeline(stages, meshes.pp.get_group(), schedule, n_mb, _summed_loss, "cpu")
    ref_params = dict(reference.named_parameters())
    params = [p for stage in stages for p in stage.module.parameters()]
    rows = BATCH  # each dp rank's half of the global batch
    out = []
    for step in range(2):
        # The global batch is two dp ranks' batches; each rank runs its half.
        halves = [_batch(10 * step + k) for k in range(2)]
        inputs, labels, documents = (torch.cat([h[i] for h in halves]) for i in range(3))
        count = (labels != IGNORE).sum().float()
        ref_loss = _summed_loss(reference(inputs, document_positions=documents), labels) / count
        ref_loss.backward()
        mine = slice(meshes.dp_rank * rows, (meshes.dp_rank + 1) * rows)
        # FSDP averages gradients over dp: scale = dp ranks / global valid tokens, as the trainer does.
        loss = pipeline.step(
            inputs[mine], labels[mine], scale=2 / count, document_positions=documents[mine].contiguous()
        )
        for stage in stages:
            for name, p in stage.module.named_parameters():
                torch.testing.assert_close(
                    p.grad.full_tensor(), ref_params[name].grad, rtol=1e-5, atol=1e-5,
                    msg=lambda m, name=name, step=step: f"{schedule} x FSDP step {step} {name}: {m}",
                )
        norm = clip_grad_norm_(params, 1e9, pp_mesh=meshes.pp)
        ref_norm = torch.nn.utils.get_total_norm([p.grad.double() for p in reference.parameters()])
        torch.testing.assert_close(norm.double(), ref_norm, rtol=1e-6, atol=0)
        out.append((None if loss is None else loss.item() / 2, ref_loss.item()))
        _sgd(ref_params.values())
        _sgd(params)  # on the local shards: the next step checks the updated weights stayed equal
    return out


# PP 4 on the same 4 ranks: name -> (schedule, n_layers, virtual stages, layers_per_stage, micro-batches)
PP4_CASES = {
    "pp4_1f1b_uneven": ("1F1B", 6, 1, [1, 2, 2, 1], 4),
    "pp4_interleaved_1f1b": ("Interleaved1F1B", 8, 2, None, 4),
}


def _fsdp_parity_on_ranks(rank, world_size, cases, pp4_cases):
    meshes = build_meshes(ParallelDims(pp=2, dp_shard=2, world_size=world_size))
    out = {name: _fsdp_case(meshes, *case) for name, case in cases.items()}
    pp4 = build_meshes(ParallelDims(pp=world_size, dp_shard=1, world_size=world_size))
    out.update({name: _run_case(rank, pp4, *case) for name, case in pp4_cases.items()})
    return out


def test_pp2_x_fsdp2_and_pp4_match_one_process():
    """Each rank asserted its gradients and the whole model's clip norm; here the losses: the last
    stage's two dp ranks each report their half (scaled by dp), whose mean is the global loss."""
    results = run_on_ranks(_fsdp_parity_on_ranks, 4, FSDP_CASES, PP4_CASES, timeout=600)
    for name, case in PP4_CASES.items():
        # Each rank asserted losses and gradients as at PP 2; stages sit on ranks s % 4, all covered.
        per_rank = [r[name] for r in results]
        assert set().union(*(r["checked"] for r in per_rank)) == set(per_rank[0]["all"]), name
        assert [r["stages"] for r in per_rank] == [[k + 4 * v for v in range(case[2])] for k in range(4)], name
        assert sum(len(r["losses"]) for r in per_rank) == STEPS and len(per_rank[3]["losses"]) == STEPS
    for name in FSDP_CASES:
        last = [r[name] for r in results if r[name][0][0] is not None]
        assert len(last) == 2, name  # the dp pair holding the last stage
        for step in range(2):
            reported = sum(ranks[step][0] for ranks in last)
            assert reported == pytest.approx(last[0][step][1], rel=1e-5), (name, step)
