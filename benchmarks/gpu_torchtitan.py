"""benchmarks/gpu.py's torchtitan runs: which torchtitan (0.3.0 or 0.2.2, by the torch), its command
line (benchmarks/torchtitan_gpu.py: torchtitan's trainer at plait's depth, batch, sequence,
causal attention and selective-AC save list, compiled), its figures from its log and trace.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

from common import ANSI, CORPUS_DIR, TT_STEP
from gpu_common import (
    CONFIGS,
    HERE,
    SAMPLES,
    batch_of,
    failure,
    keep_log,
    keep_outputs,
    layers_of,
    run_bounded,
    tail,
)
from profile_summary import step_profile


def choose_torchtitan(args) -> tuple[str, Path | None]:
    """(the torchtitan version its runs take, its site folder or None for this python's own),
    decided once: `--torchtitan-version`, or by default the one this torch runs: 0.3.0 imports
    `torch.distributed.fsdp.DataParallelMeshDims` (new in torch 2.12), 0.2.2 does not. Without
    either folder, the torchtitan this python imports (its version from its dist-info)."""
    version = args.torchtitan_version
    if version == "auto":
        import torch.distributed.fsdp as fsdp

        version = "0.3.0" if hasattr(fsdp, "DataParallelMeshDims") else "0.2.2"
    path = {"0.3.0": args.torchtitan_path, "0.2.2": args.torchtitan_022_path}[version]
    if path is None and args.torchtitan_path is None and args.torchtitan_022_path is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("torchtitan") if args.torchtitan_version == "auto" else version
        except PackageNotFoundError:
            pass
    return version, path


def _legacy(args) -> bool:
    """torchtitan 0.2.x: its CLI (TOML job config, --model.flavor, --job.*, --profiling.*)."""
    return args.tt_version.startswith(("0.1.", "0.2."))


def torchtitan_available(args) -> bool:
    if args.tt_path:
        return (Path(args.tt_path) / "torchtitan").is_dir()
    if args.torchtitan_path or args.torchtitan_022_path:  # only the other version's folder given
        return False
    return importlib.util.find_spec("torchtitan") is not None


def torchtitan_command(name: str, args, dump: Path, cuda_graphs: bool = True) -> list[str]:
    _, _, seq, _, (module, config) = CONFIGS[name]
    batch = batch_of(name, args)
    # torchtitan_gpu.py: torchtitan's trainer plus the reduced depth and a 1B config (see there), and
    # the same work as plait's run: causal attention (0.2.2's DeepSeek-V3 defaults to an EOS-split
    # mask) and plait's selective-AC save list. Text from the same local folder as plait (no hub);
    # model and loss compiled as plait compiles its blocks; one GPU, so no expert parallel.
    cmd = [sys.executable, str(HERE / "torchtitan_gpu.py"), "--layers", str(layers_of(name, args)),
           "--attention-mask", "causal", "--sac-save", "plait"]  # fmt: skip
    common = ["--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
              "--training.steps", str(args.steps), "--metrics.log_freq", "1",
              "--compile.enable", "--compile.components", "model,loss"]  # fmt: skip
    if module == "deepseek_v3":
        common += ["--parallelism.expert_parallel_degree", "1"]
    if _legacy(args):  # 0.2.2: its job config by name (torchtitan_gpu.py holds them), its own sections
        cmd += ["--config", config, "--model.hf_assets_path", str(args.tt_tokenizer),
                "--training.dataset", "c4_test", "--training.dataset_path", str(CORPUS_DIR),
                "--job.dump_folder", str(dump), *common]  # fmt: skip
        if args.profile:  # its own profiler, the last step, traces where 0.3.0 writes them
            cmd += ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps),
                    "--profiling.profiler_warmup", str(min(3, args.steps - 1)),
                    "--profiling.save_traces_folder", "profiling/traces"]  # fmt: skip
        return cmd
    cmd += ["--module", module, "--config", config, "--hf_assets_path", str(args.tt_tokenizer),
            "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(CORPUS_DIR),
            "--dump_folder", str(dump), *common]  # fmt: skip
    if not cuda_graphs:
        cmd += ["--training.disable_cuda_graphs"]
    if args.profile:  # its own profiler, the last step: wait, warmup (<= 3), one active step
        cmd += ["--profiler.enable_profiling", "--profiler.profile_freq", str(args.steps),
                "--profiler.profiler_warmup", str(min(3, args.steps - 1))]  # fmt: skip
    return cmd


def _torchtitan_env(args) -> dict:
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29591", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # fmt: skip
    if args.tt_path:  # first, for these runs only: its `datasets` never meets plait's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.tt_path), env.get("PYTHONPATH")]))
    return env


def _fake_torchtitan_outputs(dump: Path, log: Path, args, parsed: str | None) -> None:
    """--dry-run: the recorded sample log (its first line, what the parse configured, replaced by
    the real parse's where there was one) and the sample trace, written as that torchtitan writes
    it (0.3.0 gzipped, 0.2.2 plain)."""
    sample = (SAMPLES / "torchtitan.log").read_text().replace("DUMP", str(dump)).splitlines()
    if parsed:
        sample[0] = parsed
    log.write_text("\n".join(sample) + "\n")
    if args.profile:
        folder = dump / "profiling" / "traces" / f"iteration_{args.steps}"
        folder.mkdir(parents=True, exist_ok=True)
        if _legacy(args):
            shutil.copy(SAMPLES / "torchtitan_trace.json", folder / "rank0_trace.json")
        else:
            with gzip.open(folder / "rank0_trace.json.gz", "wt") as f:  # 0.3.0 writes them gzipped
                f.write((SAMPLES / "torchtitan_trace.json").read_text())


def _check_torchtitan_command(cmd: list[str], args, log: Path) -> tuple[dict | None, str | None]:
    """--dry-run: torchtitan's own parser on the command line (torchtitan_gpu.py --check-args):
    (the failure or None, the line saying what it configured)."""
    check = [cmd[0], cmd[1], "--check-args", *cmd[2:]]
    rc, timed_out = run_bounded(check, dict(_torchtitan_env(args), CUDA_VISIBLE_DEVICES=""), log, 120)
    print("\n".join(tail(log, 3)), flush=True)
    if rc != 0 or timed_out:
        return failure(rc, timed_out, 120, log), None
    return None, next((ln for ln in tail(log, 50) if ln.startswith("torchtitan_gpu.py: ")), None)


def run_torchtitan(name: str, args, workdir: Path, timeout: float | None = None, deadline=None) -> dict:
    available = torchtitan_available(args)
    if not available and not args.dry_run:
        flag = "--torchtitan-022-path" if _legacy(args) else "--torchtitan-path"
        other = args.torchtitan_path or args.torchtitan_022_path  # only the other version's folder given
        where = f"in {args.tt_path}" if args.tt_path else f"(no {flag})" if other else "here"
        return {"error": f"torchtitan {args.tt_version} not installed {where}"}
    dump = workdir / f"tt-{name}"
    log = workdir / f"tt-{name}.log"
    cmd = torchtitan_command(name, args, dump)
    print(f"[gpu] {name} torchtitan: {' '.join(cmd)}", flush=True)
    note = ""
    if args.dry_run:
        failed, parsed = _check_torchtitan_command(cmd, args, log) if available else (None, None)
        if failed:
            return {"error": f"dry run: {failed['error']}"}
        if not available:
            note = "dry run: torchtitan not importable here, its command line not parsed"
            print(f"[gpu] {note}", flush=True)
        _fake_torchtitan_outputs(dump, log, args, parsed)
        rc, timed_out = 0, False
    else:
        rc, timed_out = run_bounded(cmd, _torchtitan_env(args), log, timeout)
        left = deadline() if deadline else None
        capture = r"is capturing|StreamCapture|graph capture|capture_(begin|end)"
        graph_failed = (rc != 0 and not timed_out and not _legacy(args)
                        and re.search(capture, log.read_text(errors="replace"), re.I))  # fmt: skip
        if graph_failed and (left is None or left >= args.min_run_s):
            # Its default whole-step CUDA graph did not capture: once more without it.
            keep_log(log, args)
            shutil.rmtree(dump, ignore_errors=True)
            cmd = torchtitan_command(name, args, dump, cuda_graphs=False)
            print(f"[gpu] {name} torchtitan again without its CUDA graph: {' '.join(cmd)}", flush=True)
            note = "its CUDA graph failed: --training.disable_cuda_graphs"
            log = workdir / f"tt-{name}-no-cudagraph.log"
            rc, timed_out = run_bounded(cmd, _torchtitan_env(args), log, min(timeout or 1e9, left or 1e9))
    keep_log(log, args)
    if rc != 0 or timed_out:
        return {**failure(rc, timed_out, timeout, log), "note": note}
    return {**_figures(name, args, dump, log), "note": note}


def _figures(name: str, args, dump: Path, log: Path) -> dict:
    """A finished torchtitan run's figures from its log (medians of the steps after the warmup) and
    its last profiled step; what its launcher configured (compile, CUDA graph, SAC, attention) and
    whether that is the same work as plait's run of the config (`equal_work`)."""
    text = ANSI.sub("", log.read_text())
    tps = [float(m.group(2).replace(",", "")) for m in TT_STEP.finditer(text) if int(m.group(1)) > args.warmup]
    mfu = [float(x) for x in re.findall(r"mfu:\s*([\d.]+)%", text)[args.warmup :]]
    mem = [float(x) for x in re.findall(r"memory:\s*([\d.]+)GiB", text)]
    traces = sorted(dump.glob("profiling/traces/iteration_*/rank0_trace.json*"),
                    key=lambda p: int(p.parent.name.split("_")[-1])) if args.profile else []  # fmt: skip
    line = next((ln for ln in text.splitlines() if ln.startswith("torchtitan_gpu.py: ")), "")
    graphs = re.search(r"CUDA graphs (True|False)", line)
    sac = re.search(r", SAC ([^,]+)", line)
    attention = re.search(r", attention (.+)", line)
    mode = "compile + whole-step CUDA graph" if graphs and graphs.group(1) == "True" else "compile"
    attention = attention.group(1).strip() if attention else "?"
    tokens = CONFIGS[name][2] * batch_of(name, args)
    # plait's work: compiled, the whole causal row (not 0.3.0's block-causal mask), plait's SAC save list
    equal_work = "compile True" in line and attention.endswith(" causal") and bool(sac) and "plait" in sac.group(1)
    return {
        "profile": step_profile(traces[-1]) if traces else None,
        "tt_mode": f"{mode}; attention {attention}" + (f"; SAC {sac.group(1)}" if sac else ""),
        "tt_attention": attention,
        "tt_sac": sac.group(1) if sac else "?",
        "equal_work": equal_work,
        "tokens_per_second": statistics.median(tps) if tps else float("nan"),
        "step_ms_wall": statistics.median(tokens / t for t in tps) * 1e3 if tps else float("nan"),
        "mfu": statistics.median(mfu) / 100 if mfu else float("nan"),
        "memory_gib": max(mem) if mem else float("nan"),
        "layers": layers_of(name, args),
        **keep_outputs(args, f"tt-{name}", None, traces[-1] if traces else None),
    }
