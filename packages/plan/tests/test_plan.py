"""plait-plan's command line: the same validation and one-line errors as plait-train, the table
and its JSON, the device check. (Layouts that need the parallel packages, a shipped config at its
full world size included: tests/test_combo_trainer_plan_measured.py; the 671B config at 512 ranks,
timed: benchmarks/plan_scale.py.)"""

import json

import pytest
import torch

from plait.plan import cli as plan_cli
from plait.plan import planning
from plait.trainer import cli as train_cli
from plait.trainer.config import ConfigError

SMALL = ["--model.n_layers", "2", "--training.local_batch_size", "2", "--training.seq_len", "64"]


def test_plan_flags_are_split_from_the_trainers():
    plan, rest = plan_cli.split_plan_args(
        ["--plan.world_size", "8", "--parallelism.tp", "2", "--plan.device=h200", "--plan.json", "x.json"])
    assert (plan.world_size, plan.device, plan.json, plan.device_memory_gib) == (8, "h200", "x.json", None)
    assert rest == ["--parallelism.tp", "2"]
    for bad, words in ((["--plan.world_size", "0"], "world_size"), (["--plan.device", "a100"], "h100 or h200"),
                       (["--plan.size", "2"], "unknown option"), (["--plan.json"], "needs a value")):
        with pytest.raises(ConfigError, match=words):
            plan_cli.split_plan_args(bad)


BAD_LAYOUTS = {
    "dp_shard_not_world": ["--parallelism.dp_shard", "3"],
    "ep_without_experts": ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
    "tp_not_dividing_kv_heads": ["--parallelism.tp", "2", "--model.n_kv_heads", "1"],
    "cp_not_dividing_seq_len": ["--parallelism.cp", "2", "--training.seq_len", "66"],
}


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_bad_layout_fails_as_plait_train_does(case, tmp_path, capsys):
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, *BAD_LAYOUTS[case]]  # later flags win
    assert train_cli.main(["--nproc-per-node", "2", *flags]) == 2
    trained = capsys.readouterr().err.strip()
    assert plan_cli.main(["--plan.world_size", "2", *flags]) == 2
    planned = capsys.readouterr().err.strip()
    assert trained.startswith("plait-train: error: ") and planned.startswith("plait-plan: error: ")
    assert planned.removeprefix("plait-plan: ") == trained.removeprefix("plait-train: ")
    assert "\n" not in planned


def test_table_json_and_fit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--parallelism.dp_shard", "2", "--plan.world_size", "2"]
    assert plan_cli.main([*flags, "--plan.json", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "peak in" in table and "dp_shard all_gather" in table and "fits in 74.5 GiB" in table
    assert report["fits"] and report["layout"]["dp_shard"] == 2
    memory = report["memory"]
    assert memory["optimizer"] == 2 * memory["parameters"] > 0
    assert memory["peak"] >= memory["parameters"] + memory["optimizer"]
    kinds = {(c["axis"], c["kind"]) for c in report["communication"]}
    assert {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")} <= kinds
    assert report["analytic_estimate"]["model state"] > 0 and report["compute_seconds"] > 0
    # The same layout on a device too small for its peak (with 10% headroom).
    too_small = memory["peak"] / 2**30 * 1.05
    assert plan_cli.main([*flags, "--plan.device_memory_gib", str(too_small)]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bf16_optimizer_states_are_counted_as_traced(tmp_path, capsys):
    """optimizer.state_dtype = bf16: the traced optimizer's moments are bf16 (4 bytes per parameter
    element, as many as the fp32 weights), and the analytic model state is 12 bytes per element."""
    out = tmp_path / "plan.json"
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--parallelism.dp_shard", "2", "--plan.world_size", "2"]
    assert plan_cli.main([*flags, "--optimizer.state_dtype", "bf16", "--plan.json", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    memory = report["memory"]
    assert memory["optimizer"] == memory["parameters"] > 0
    assert report["analytic_estimate"]["model state"] == pytest.approx(3 * memory["parameters"], rel=1e-3)


def _search(tmp_path, monkeypatch, extra=()):
    """--plan.search over data-parallel layouts only (this session has no tp / cp / pp packages; the
    search would count those as invalid anyway) of the debug model at 2 ranks."""
    from plait.plan import search as plan_search

    monkeypatch.setattr(plan_search, "MAX_TP", 1)
    monkeypatch.setattr(plan_search, "MAX_CP", 1)
    monkeypatch.setattr(plan_search, "MAX_PP", 1)
    out = tmp_path / "search.json"
    base = ["--job.dump_folder", str(tmp_path), "--model.n_layers", "1", "--training.local_batch_size", "2",
            "--training.seq_len", "32"]
    argv = [*base, "--plan.search", "--plan.world_size", "2", "--plan.json", str(out), *extra]
    return base, argv, out


def test_search_lists_valid_fitting_layouts_by_comm_per_token_as_plait_train_flags(tmp_path, monkeypatch, capsys):
    from plait.plan.search import traced_comm_per_token
    from plait.trainer.validate import validate

    base, argv, out = _search(tmp_path, monkeypatch)
    assert plan_cli.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    counts, fits = result["counts"], result["fits"]
    # 2 degree layouts (dp_shard 2, dp_replicate 2) x micro-batch 1 x 2 or 2 x 1 x AC none / selective / full.
    assert counts["candidates"] == 12 and counts["invalid"] == 0
    assert counts["traced"] == counts["fit"] == len(fits) == 2  # one per degree layout, the rest are its variants
    assert counts["variants_of_fitting"] == 10 and not result["pp_searched"]
    per_token = [row["comm_bytes_per_token"] for row in fits]
    assert per_token == sorted(per_token) and per_token[0] > 0
    assert "--parallelism.dp_shard 2" in table and "searched: pp <= 1" in table
    for row in fits:
        assert row["report"]["fits"]
        assert row["comm_bytes_per_token"] == traced_comm_per_token(row["report"], 2)
        # The flags go through plait-train's own parser into the same layout, which validates.
        parsed = train_cli.parse_args([*base, *row["flags"]])
        config = plan_cli_config(parsed)
        plan = validate(config, world_size=2)
        layout = row["report"]["layout"]
        assert (plan.dims.dp_replicate, plan.dims.dp_shard, plan.dims.tp) == (layout["dp_replicate"],
                                                                            layout["dp_shard"], layout["tp"])
        t = config.training
        assert [t.local_batch_size, t.seq_len] == row["report"]["micro_batch"]
        assert t.gradient_accumulation_steps == row["report"]["gradient_accumulation_steps"]
        assert t.activation_checkpoint == row["report"]["activation_checkpoint"] == "none"
        # The config's global batch (2 x 2 ranks) is kept.
        assert t.local_batch_size * t.gradient_accumulation_steps * layout["dp_replicate"] * layout["dp_shard"] == 4


def plan_cli_config(parsed):
    from plait.trainer.cli import DEFAULT_CONFIG
    from plait.trainer.config import build_config, load_toml

    return build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)


def test_search_on_a_device_too_small_lists_none(tmp_path, monkeypatch, capsys):
    _, argv, out = _search(tmp_path, monkeypatch, ["--plan.device_memory_gib", "0.001"])
    assert plan_cli.main(argv) == 0
    assert "no traced layout fits" in capsys.readouterr().out
    counts = json.loads(out.read_text())["counts"]
    assert json.loads(out.read_text())["fits"] == []
    # The analytic estimate drops what is over twice the memory; what is traced and does not fit
    # rules out every candidate needing at least its memory.
    assert counts["over_memory"] + counts["do_not_fit"] + counts["heavier_than_not_fitting"] == counts["candidates"]


@pytest.mark.parametrize("extra, words", [
    ([], "--plan.search needs --plan.world_size"),
    (["--plan.world_size", "6"], "powers of two"),
    (["--plan.world_size", "2", "--plan.search_limit", "0"], "--plan.search_limit = '0'"),
    (["--plan.world_size", "2", "--plan.search=maybe"], "--plan.search = 'maybe'"),
])
def test_search_bad_input_is_one_line_and_exit_2(extra, words, tmp_path, capsys):
    assert plan_cli.main(["--job.dump_folder", str(tmp_path), "--plan.search", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plait-plan: error: ") and words in err and "\n" not in err


def test_host_ops_in_json_positive_and_the_same_for_the_same_plan(tmp_path, capsys):
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        assert plan_cli.main(["--job.dump_folder", str(tmp_path), *SMALL, "--plan.json", str(out)]) == 0
    table = capsys.readouterr().out
    first, second = (json.loads(out.read_text()) for out in outs)
    assert 0 < first["host_kernel_ops_per_step"] < first["host_ops_per_step"]
    assert f"host ops per step: {first['host_ops_per_step']} (kernel launches: " in table
    assert sum(first["host_ops_by_op"].values()) == first["host_ops_per_step"]
    assert "aten::mm" in first["host_ops_by_op"] and "aten::_fused_adamw_" in first["host_ops_by_op"]
    for key in ("host_ops_per_step", "host_kernel_ops_per_step", "host_ops_by_op"):
        assert first[key] == second[key], key


def _trace(tmp_path, extra, **kwargs):
    from plait.plan.trace import trace_step
    from plait.trainer.validate import validate

    config = plan_cli_config(train_cli.parse_args(["--job.dump_folder", str(tmp_path), *SMALL, *extra]))
    return trace_step(config, validate(config, world_size=1), **kwargs)


def _measured_host_ops(rank, world_size, argv):
    from plait.plan.measure import measured_step

    traced = measured_step(argv)
    return traced.host_ops, traced.host_kernel_ops


def test_host_ops_of_a_plan_are_the_real_steps(tmp_path):
    """The traced step (fake tensors) dispatches the ops a real step of the same layout does: the
    first step's optimizer, which also makes its state, counted as a later step's."""
    from plait.testing import run_on_ranks

    traced = _trace(tmp_path, [])
    argv = ["--job.dump_folder", str(tmp_path / "real"), *SMALL]
    assert run_on_ranks(_measured_host_ops, 1, argv, timeout=120)[0] == (traced.host_ops, traced.host_kernel_ops)


def test_document_masked_host_ops_do_not_grow_with_documents(tmp_path):
    """A document mask is one attention op per layer, however many documents a row holds."""
    document = ["--model.attention_mask", "document", "--training.seq_len", "256"]
    one, eight = (_trace(tmp_path, document, documents_per_row=n) for n in (1, 8))
    assert one.host_ops == eight.host_ops and one.host_kernel_ops == eight.host_kernel_ops
    assert one.host_ops_by_op == eight.host_ops_by_op


def test_moe_ops_do_not_depend_on_the_tokens_each_expert_receives():
    """Every token routed to the same experts (the others get none) or spread: the same ops."""
    import torch

    from plait.models.moe import MoE, TokenChoiceTopKRouter
    from plait.plan.host_ops import HostOpCounter

    torch.manual_seed(0)
    moe = MoE(32, 48, 8, 1, TokenChoiceTopKRouter(32, 8, 3, score_func="sigmoid", route_norm=True))
    moe.init_weights(0.02)
    counts = []
    for x in (torch.randn(2, 16, 32), torch.ones(2, 16, 32)):
        moe.zero_grad(set_to_none=True)
        counter = HostOpCounter()
        with counter:
            moe(x.requires_grad_()).sum().backward()
        counts.append(counter.by_op())
    spread, same = counts
    assert spread == same and sum(spread.values()) > 0


# ---- issue 40: a device-honest planner, documents, no data, bounds and flags -------------------

ROUTE_FLAGS = ["--training.dtype", "bfloat16", "--training.activation_checkpoint", "selective", "--model.n_layers",
               "2", "--training.local_batch_size", "2", "--training.seq_len", "128"]
ROUTE_CASES = {
    "deepseek_v3": ["--config", "deepseek_v3_debugmodel.toml"],
    "llama3": ["--config", "llama3_debugmodel.toml"],
    "llama3_fsdp_8": ["--config", "llama3_debugmodel.toml", "--plan.world_size", "8"],
    "deepseek_v3_fsdp_4_cp_2": ["--config", "deepseek_v3_debugmodel.toml", "--plan.world_size", "8",
                                "--parallelism.cp", "2"],
}


def _force_cpu_bf16_units(monkeypatch, units: bool) -> None:
    """This CPU as one with (True) or without (False) bf16 units, for the models and context parallel."""
    from plait.models import cpu_bf16

    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", units)
    try:
        from plait.contextparallel import kernels
    except ImportError:
        return
    monkeypatch.setattr(kernels, "CPU_HALF_IN_FP32", not units)


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_a_gpu_plan_does_not_depend_on_the_cpus_bf16_units(case, tmp_path, monkeypatch, capsys):
    """plait-plan traces a GPU's kernel routes: a CPU without bf16 units (fp32 products, fp32
    attention, MLA's padded values) plans what a CPU with them plans, field for field."""
    if "--parallelism.cp" in ROUTE_CASES[case]:
        pytest.importorskip("plait.contextparallel")
    reports = {}
    for units in (True, False):
        _force_cpu_bf16_units(monkeypatch, units)
        out = tmp_path / f"{units}.json"
        argv = ["--job.dump_folder", str(tmp_path), *ROUTE_CASES[case], *ROUTE_FLAGS, "--plan.json", str(out)]
        assert plan_cli.main(argv) == 0
        reports[units] = json.loads(out.read_text())
    capsys.readouterr()
    with_units, without = reports[True], reports[False]
    assert with_units["memory"]["activations"] > 0 and with_units["host_ops_per_step"] > 0
    for key in with_units:
        assert with_units[key] == without[key], key
    assert with_units["kernel_route"] == "gpu"
    ops = with_units["host_ops_by_op"]
    if case.startswith("deepseek_v3"):
        assert "aten::_grouped_mm" in ops  # the experts' bf16 GEMM, not an fp32 custom op
    if case == "deepseek_v3":
        # MLA's attention as a GPU runs it (values 128 wide, queries 192): no padded values.
        assert "aten::_scaled_dot_product_efficient_attention" in ops and "aten::constant_pad_nd" not in ops
        # The CPU's own routes (what a measured step on it runs) do depend on the units: the test bites.
        host = {}
        for units in (True, False):
            _force_cpu_bf16_units(monkeypatch, units)
            host[units] = _trace(tmp_path, ROUTE_CASES[case] + ROUTE_FLAGS[:-2])
        assert host[True].activations != host[False].activations


def _token_folder(path, lengths):
    """A pre-tokenised folder (data/token_format.py) of documents of these lengths."""
    import numpy as np

    path.mkdir()
    total = sum(lengths)
    np.zeros(total, np.uint32).tofile(path / "tokens.bin")
    np.save(path / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    meta = {"num_documents": len(lengths), "num_tokens": total, "max_id": 0, "n_words": 2048, "bos_id": 0,
            "eos_id": 1, "tokenizer": "none"}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_document_masks_are_traced_with_document_boundaries(tmp_path, monkeypatch, capsys):
    """--plan.document_tokens, or a pre-tokenised folder's mean, or the default: the traced rows
    hold seq_len / that many documents (pp too), shown in the JSON and the printed assumptions."""
    from plait.plan import trace, traced_step

    seen = []
    real = trace.micro_batch

    def spy(config, seq_len=None, documents_per_row=1):
        seen.append(documents_per_row)
        return real(config, seq_len, documents_per_row)

    monkeypatch.setattr(trace, "micro_batch", spy)
    monkeypatch.setattr(traced_step, "micro_batch", spy)  # the pipeline trace's
    document = ["--job.dump_folder", str(tmp_path), *SMALL, "--training.seq_len", "256",
                "--model.attention_mask", "document"]
    out = tmp_path / "plan.json"

    def plan(*extra):
        seen.clear()
        assert plan_cli.main([*document, *extra, "--plan.json", str(out)]) == 0
        return json.loads(out.read_text()), capsys.readouterr().out

    report, table = plan("--plan.document_tokens", "64")
    assert report["documents"] == {"document_tokens": 64, "documents_per_row": 4, "source": "--plan.document_tokens"}
    assert seen == [4] and "document mask: 4 documents of 64 tokens per row" in table
    # More documents per row than the offsets' first capacity (16): it grows (the 64K config's 32
    # documents a row failed "the offsets have room for 16" before).
    report, table = plan("--plan.document_tokens", "8")
    assert report["documents"]["documents_per_row"] == 32 and seen == [32]
    report, table = plan()
    assert report["documents"]["document_tokens"] == planning.DEFAULT_DOCUMENT_TOKENS == 2048
    assert seen == [1] and "the default" in report["documents"]["source"] and "mean document length 2048" in table
    folder = _token_folder(tmp_path / "tokens", [32, 32, 32, 32])  # mean 32 tokens
    report, _ = plan("--data.dataset", "tokens", "--data.dataset_path", str(folder), "--data.val_interval", "0")
    assert report["documents"]["documents_per_row"] == 8 and seen == [8] and str(folder) in report["documents"]["source"]
    # A causal mask sees no documents: one per row.
    assert plan_cli.main(["--job.dump_folder", str(tmp_path), *SMALL, "--plan.json", str(out)]) == 0
    assert json.loads(out.read_text())["documents"]["source"].startswith("causal mask")
    assert "causal mask: documents not traced" in capsys.readouterr().out
    # Pipeline parallel traces its micro-batches on the same rows.
    pytest.importorskip("plait.pipelineparallel")
    report, _ = plan("--plan.document_tokens", "32", "--plan.world_size", "2", "--parallelism.pp", "2",
                     "--parallelism.dp_shard", "1")
    assert report["pipeline"] and report["documents"]["documents_per_row"] == 8 and seen == [8]


def test_a_plan_reads_no_tokenizer_and_no_dataset(tmp_path, capsys):
    """A tokenizer file and a dataset that are not on this machine: plait-train refuses, plait-plan
    plans (the model's vocab_size stands in, and the assumptions say so)."""
    from plait.trainer.validate import validate

    missing = ["--model.tokenizer_path", str(tmp_path / "no" / "tokenizer.model"), "--data.dataset", "json",
               "--data.dataset_path", str(tmp_path / "no" / "corpus.jsonl")]
    config = plan_cli_config(train_cli.parse_args(["--job.dump_folder", str(tmp_path), *SMALL, *missing]))
    with pytest.raises(ConfigError, match="not found"):
        validate(config, world_size=1)
    assert validate(config, world_size=1, need_data=False).tokenizer is None
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--job.dump_folder", str(tmp_path), *SMALL, *missing, "--plan.json", str(out)]) == 0
    assert "no tokenizer or dataset read: the model's vocab_size 2048" in capsys.readouterr().out
    assert json.loads(out.read_text())["vocab_size"] == 2048


def test_fsdp_chunks_of_a_large_world_are_torchs(tmp_path, monkeypatch, capsys):
    """The planner's FSDP chunks (made only where read) are torch's, for every rank and the 0th,
    and a plan over 128 ranks is the same with torch's own chunks."""
    import contextlib

    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    from plait.plan.trace import _LazyChunks

    for rows, ranks in ((256, 100), (1000, 4096), (7, 65), (129280, 1000), (3, 3000)):
        t = torch.arange(rows * 2).reshape(rows, 2)
        eager, lazy = _fsdp_common._chunk_with_empty(t, ranks, 0), _LazyChunks(t, ranks, 0)
        assert len(lazy) == len(eager) == ranks
        for i in (0, 1, ranks // 2, ranks - 1, -1):
            assert lazy[i].shape == eager[i].shape and torch.equal(lazy[i], eager[i])
            assert lazy[i].storage_offset() == eager[i].storage_offset() or eager[i].numel() == 0
    from plait.plan import trace

    reports = []
    for chunks in (trace.rank_zero_chunks, contextlib.nullcontext):
        monkeypatch.setattr(trace, "rank_zero_chunks", chunks)
        out = tmp_path / f"{len(reports)}.json"
        argv = ["--job.dump_folder", str(tmp_path), *SMALL, "--plan.world_size", "128", "--plan.json", str(out)]
        assert plan_cli.main(argv) == 0
        reports.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert reports[0] == reports[1] and reports[0]["layout"]["dp_shard"] == 128


def test_a_plan_of_100_000_ranks_takes_seconds_and_a_larger_world_than_the_bound_is_one_line(tmp_path, capsys):
    """FSDP over 100,000 ranks (once: minutes, per-rank chunks of every parameter); 10^9 ranks
    (once: 23 GB, then the OOM killer) is refused before anything is built."""
    import time

    out = tmp_path / "plan.json"
    start = time.perf_counter()
    assert plan_cli.main(["--job.dump_folder", str(tmp_path), *SMALL, "--plan.world_size", "100000",
                          "--plan.json", str(out)]) == 0
    assert time.perf_counter() - start < 60
    assert json.loads(out.read_text())["layout"]["dp_shard"] == 100000
    capsys.readouterr()
    for argv in (["--plan.world_size", "1000000000"], ["--plan.world_size", str(planning.MAX_WORLD_SIZE + 1)],
                 ["--plan.search", "--plan.world_size", str(2 * planning.MAX_WORLD_SIZE)],
                 ["--parallelism.dp_shard", str(planning.MAX_WORLD_SIZE), "--parallelism.tp", "2"]):
        assert plan_cli.main(["--job.dump_folder", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("plait-plan: error: --plan.world_size = ") and "at most 1,048,576 ranks" in err
        assert "\n" not in err


@pytest.mark.parametrize("flags, words", [
    (["--plan.device_memory_gib", "nan"], "--plan.device_memory_gib = 'nan': expected a finite number"),
    (["--plan.device_memory_gib", "inf"], "--plan.device_memory_gib = 'inf': expected a finite number"),
    (["--plan.device_memory_gib=-inf"], "--plan.device_memory_gib = '-inf'"),
    (["--nproc-per-node", "2"], "--nproc-per-node: plait-plan starts no ranks; the plan's world is --plan.world_size"),
    (["--nproc_per_node=1"], "--nproc_per_node: plait-plan starts no ranks"),
    (["--plan.document_tokens", "0"], "--plan.document_tokens = '0'"),
    (["--plan.json", "{tmp}/no/such/folder/plan.json"], "cannot write it (No such file or directory)"),
    (["--plan.json", "{tmp}"], "cannot write it (Is a directory)"),
    (["--plan.search", "--plan.world_size", "2", "--plan.json", "{tmp}"], "cannot write it (Is a directory)"),
])
def test_plan_flags_refused_in_one_line_before_tracing(flags, words, tmp_path, monkeypatch, capsys):
    from plait.plan import search, trace

    def no_trace(*args, **kwargs):
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(trace, "trace_step", no_trace)
    monkeypatch.setattr(search, "search", no_trace)
    argv = ["--job.dump_folder", str(tmp_path), *SMALL, *(f.format(tmp=tmp_path) for f in flags)]
    assert plan_cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("plait-plan: error: ") and words in err and "\n" not in err
    assert captured.out == ""
    assert not (tmp_path / "no").exists()


def test_float8_is_planned_at_the_float8_peak_with_float8_all_gathers(tmp_path, capsys):
    """training.float8 tensorwise under FSDP: the float8 linears' FLOPs at the device's float8
    peak (less compute time than bf16's plan of the same step), the weights all-gathered in float8
    (fewer all-gather bytes), as the traced step does it."""
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--parallelism.dp_shard", "2", "--plan.world_size", "2",
             "--training.dtype", "bfloat16", "--training.float8_filter", "divisible"]  # fmt: skip
    reports = {}
    for recipe in ("off", "tensorwise"):
        out = tmp_path / f"{recipe}.json"
        assert plan_cli.main([*flags, "--training.float8", recipe, "--plan.json", str(out)]) == 0
        reports[recipe] = json.loads(out.read_text())
    capsys.readouterr()
    bf16, float8 = reports["off"], reports["tensorwise"]
    assert float8["flops_per_rank"] == bf16["flops_per_rank"] and float8["compute_seconds"] < bf16["compute_seconds"]

    def gathered(report):
        return sum(c["bytes"] for c in report["communication"] if c["kind"] == "all_gather")

    assert gathered(float8) < gathered(bf16)


def test_float8_experts_are_planned_at_the_float8_peak(tmp_path, capsys):
    """training.float8_experts: the routed experts' grouped GEMMs (3 per expert a token reaches) at
    the float8 peak, the traced step running the experts through the float8 grouped GEMM."""
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--model.name", "deepseek_v3", "--plan.world_size", "1",
             "--training.dtype", "bfloat16"]  # fmt: skip
    reports = {}
    for recipe in ("off", "mxfp8"):
        out = tmp_path / f"{recipe}.json"
        assert plan_cli.main([*flags, "--training.float8_experts", recipe, "--plan.json", str(out)]) == 0
        reports[recipe] = json.loads(out.read_text())
    capsys.readouterr()
    bf16, float8 = reports["off"], reports["mxfp8"]
    assert float8["float8_experts"] == "mxfp8" and float8["flops_per_rank"] == bf16["flops_per_rank"]
    # DeepSeek-V3 debug, 2 layers (1 MoE): 6 x 3 x dim 256 x hidden 256 x top-3 per token, moved from
    # the H100's bf16 peak (989 TFLOP/s) to its float8 peak (1979).
    experts_flops = 2 * 64 * 6 * 3 * 256 * 256 * 3
    saved = experts_flops / 989e12 - experts_flops / 1979e12
    assert float8["compute_seconds"] == pytest.approx(bf16["compute_seconds"] - saved, rel=1e-6)


def test_mtp_depths_are_planned(tmp_path, capsys):
    """model.mtp_layers: the plan traces the depth's block, its shifted-token embedding and its pass
    through the shared head (memory, collectives) and counts its FLOPs (the model's flops_per_token)."""
    from plait.models.deepseek_v3 import ModelArgs, Transformer

    flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--model.name", "deepseek_v3", "--plan.world_size", "2",
             "--parallelism.dp_shard", "2"]  # fmt: skip
    reports = {}
    for depths in ("0", "1"):
        out = tmp_path / f"mtp{depths}.json"
        assert plan_cli.main([*flags, "--model.mtp_layers", depths, "--plan.json", str(out)]) == 0
        reports[depths] = json.loads(out.read_text())
    capsys.readouterr()
    none, one = reports["0"], reports["1"]
    debug = dict(n_layers=2, max_seq_len=64)
    expected = Transformer.flops_per_token  # per token, from the args alone
    with torch.device("meta"):
        ratio = expected(Transformer(ModelArgs(**debug, mtp_layers=1)), 64) / expected(Transformer(ModelArgs(**debug)), 64)
    assert one["flops_per_rank"] == pytest.approx(none["flops_per_rank"] * ratio, rel=1e-9) and ratio > 1.3
    assert one["memory"]["parameters"] > none["memory"]["parameters"]
    assert one["memory"]["activations"] > none["memory"]["activations"]

    def gathered(report):
        return sum(c["bytes"] for c in report["communication"] if c["kind"] == "all_gather")

    assert gathered(one) > gathered(none)


def test_chunked_loss_lowers_the_traced_peak_by_at_least_the_logits(tmp_path):
    """training.loss = chunked (issue 54): the traced step's peak is lower than the unfused loss's by
    at least the logits' size (one row's [tokens, vocab] in fp32), and no logits are held for
    backward (the head hands the loss per-token losses)."""
    vocab, tokens = 32768, 8 * 128  # the step's logits (128 MiB) well above its weights (74 MB)
    flags = ["--model.vocab_size", str(vocab), "--training.loss_chunk_tokens", "64", "--training.local_batch_size",
             "8", "--training.seq_len", "128"]  # fmt: skip
    full = _trace(tmp_path, [*flags, "--training.loss", "full"])
    chunked = _trace(tmp_path, [*flags, "--training.loss", "chunked"])
    logits_bytes = tokens * vocab * 4
    assert full.logits == logits_bytes and chunked.logits == tokens * 4
    assert full.peak - chunked.peak >= logits_bytes, (full.peak, chunked.peak)
    assert chunked.params == full.params  # the same output.weight


def test_chunked_loss_under_fsdp_gathers_and_reduces_the_output_weight_once(tmp_path, capsys):
    """The chunk loop runs inside one call of the head's FSDP unit: the step's collectives (count and
    bytes per kind) are the unfused loss's, however many chunks (here 8 per micro-batch)."""
    reports = {}
    for loss in ("full", "chunked"):
        out = tmp_path / f"{loss}.json"
        flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--parallelism.dp_shard", "2", "--plan.world_size", "2",
                 "--training.loss", loss, "--training.loss_chunk_tokens", "16", "--plan.json", str(out)]  # fmt: skip
        assert plan_cli.main(flags) == 0
        reports[loss] = json.loads(out.read_text())
    capsys.readouterr()
    assert reports["chunked"]["communication"] == reports["full"]["communication"]
    assert reports["chunked"]["memory"]["peak"] < reports["full"]["memory"]["peak"]
