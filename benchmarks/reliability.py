"""The fault matrix of issue 13 against `plait-train`, in real subprocesses with real signals.

    python benchmarks/reliability.py            # or: nox -s reliability   (5-10 min on 2 CPU cores)
    python benchmarks/reliability.py --only checkpoints27,rank_killed,grace   # groups alone (see ONLY)

Each row injects one fault into a short run of the Llama 3 debug model (fp32, deterministic, 2
sequences of 64 tokens per step, warmup 2 then a constant lr, so the schedule does not depend on
training.steps and runs of any length share their first steps), then prints: the exit code(s),
the checkpoints left, whether the run resumed afterwards (or the run that survived the fault)
has the same per-step losses as an uninterrupted run (`==`), and whether every good state
survived. The script exits 1 if any row lost a good state.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# fmt: off
COMMON = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--training.dtype", "float32",
    "--training.deterministic", "true",
    "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay", "none",
    "--optimizer.lr", "3e-3",
    "--metrics.cpu_peak_tflops", "0.1",
    "--metrics.tensorboard", "false",
    "--metrics.progress_bar", "false",
    "--checkpoint.enable", "true",
]
TWO_RANKS = ["--nproc-per-node", "2", "--training.local_batch_size", "1"]
# fmt: on
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")


@dataclass
class Row:
    fault: str
    exit_codes: str
    checkpoints: str
    resumed_equal: str
    good_state_kept: bool


def command(dump: Path, *args: str, launcher: list[str] | None = None) -> list[str]:
    launcher = launcher or [sys.executable, "-m", "plait.trainer"]
    return [*launcher, *COMMON, "--job.dump_folder", str(dump), *args]


def cli(dump: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(dump, *args), capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})})


def start(dump: Path, *args: str, launcher: list[str] | None = None, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(command(dump, "--training.steps", "100000", "--metrics.log_freq", "1", *args, launcher=launcher),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})  # fmt: skip


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(f"step {step:>6}"):
            return
        if not line and proc.poll() is not None:
            raise RuntimeError(f"run ended ({proc.returncode}) before step {step}: {proc.stderr.read()[-1500:]}")
    raise RuntimeError(f"no step {step} within {timeout} s")


def steps(dump: Path) -> list[int]:
    """Published checkpoints (a rejected one kept aside, `step-N.rejected-<run>`, is not one)."""
    folder = dump / "checkpoints"
    return sorted(
        int(p.name[5:]) for p in folder.glob("step-*") if p.name[5:].isdigit() and (p / ".complete").is_file()
    )


def unpublished_but_named(dump: Path) -> list[Path]:
    """`step-N` folders (not `.tmp-`) without a marker: a half-written save posing as a checkpoint."""
    folder = dump / "checkpoints"
    return [p for p in folder.glob("step-*") if ".tmp-" not in p.name and not (p / ".complete").is_file()]


def marker(dump: Path, step: int) -> dict:
    return json.loads((dump / "checkpoints" / f"step-{step:06d}" / ".complete").read_text())


def losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def equal(dump: Path, reference: dict[int, float], from_step: int, to_step: int) -> str:
    got = losses(dump)
    same = all(got.get(s) == reference.get(s) for s in range(from_step, to_step + 1))
    return f"{'yes' if same else 'NO'} (steps {from_step}-{to_step})"


def flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def first_error(result: subprocess.CompletedProcess, after: str = "error: ") -> str:
    """The error line's text from `after` on."""
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    return lines[0].split(after, 1)[-1] if lines else ""


def exit_status(dump: Path) -> str:
    """What the run wrote to <dump>/exit_status (torchrun's own exit code hides a rank's 75)."""
    file = dump / "exit_status"
    return file.read_text().strip() if file.is_file() else "-"


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


class Matrix:
    def __init__(self, root: Path, references: bool = True):
        self.root = root
        self.rows: list[Row] = []
        if not references:  # --only rows that need no reference runs
            return
        # Uninterrupted references: 1 rank and 2 ranks (FSDP), 12 steps, a checkpoint every 4.
        self.ref1 = self.fresh("ref1")
        self.check(cli(self.ref1, "--training.steps", "12", "--checkpoint.interval", "4"), 0)
        self.ref2 = self.fresh("ref2")
        self.check(cli(self.ref2, *TWO_RANKS, "--training.steps", "12", "--checkpoint.interval", "4"), 0)
        self.losses1, self.losses2 = losses(self.ref1), losses(self.ref2)

    def fresh(self, name: str, copy_of: Path | None = None) -> Path:
        dump = self.root / name
        if copy_of is not None:
            shutil.copytree(copy_of, dump)
        return dump

    @staticmethod
    def check(result: subprocess.CompletedProcess, expected: int) -> subprocess.CompletedProcess:
        if result.returncode != expected:
            raise RuntimeError(f"exit {result.returncode}, expected {expected}: {result.stderr[-1500:]}")
        return result

    def add(self, *row) -> None:
        self.rows.append(Row(*row))
        print(f"  {row[0]}: exit {row[1]}", flush=True)

    # ---- data loss ----------------------------------------------------------------------------

    def nan(self) -> None:
        dump = self.fresh("nan")
        diverged = cli(dump, "--training.steps", "20", "--optimizer.lr", "1e6", "--lr_scheduler.warmup_steps", "20000",
                       "--metrics.log_freq", "20", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2")  # fmt: skip
        first = losses(dump)
        kept = steps(dump)
        resumed = cli(dump, "--training.steps", "5", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "20000")
        same = "yes" if losses(dump).get(5) == first.get(5) else "NO"
        self.add(
            "NaN from step 5 (lr 1e6, save every 2, keep_last 2)",
            f"{diverged.returncode}, resume {resumed.returncode}",
            f"{kept} (finite only); error names step-000004",
            f"{same} (step 5 from step 4's weights)",
            kept == [2, 4] and "step-000004 (step 4)" in diverged.stderr and "resuming from" in resumed.stdout,
        )

    def timeline(self) -> None:
        base = self.fresh("timeline")
        self.check(cli(base, "--training.steps", "12", "--checkpoint.interval", "4", "--checkpoint.keep_last", "2"), 0)
        branch = ["--training.steps", "12", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2",
                  "--optimizer.lr", "1e-3"]  # fmt: skip
        straight = self.fresh("timeline_straight", copy_of=base)
        self.check(cli(straight, *branch, "--checkpoint.load_step", "8"), 0)
        killed = cli(base, *branch, "--checkpoint.load_step", "8", env={"PLAIT_TEST_KILL_AFTER_SAVE": "10"})
        after_kill = steps(base)
        resumed = self.check(cli(base, *branch), 0)
        picked = "step-000010 (step 10" in resumed.stdout
        self.add(
            "load_step 8 + keep_last 2, SIGKILL after its step-10 save",
            f"{killed.returncode}, resume {resumed.returncode}",
            f"{after_kill} -> resumed this run's 10, not the old 12",
            equal(base, losses(straight), 11, 12),
            after_kill == [10, 12] and picked,
        )

    def lock(self) -> None:
        dump = self.fresh("lock")
        first = start(dump)
        try:
            wait_for_step(first, 2)
            t0 = time.monotonic()
            second = cli(dump, "--training.steps", "4")
            second_s = time.monotonic() - t0
            launched = cli(dump, *TWO_RANKS, "--training.steps", "4")
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=120)
        finally:
            first.kill()
        stop = steps(dump)
        trained = max(losses(dump))
        ok = second.returncode == launched.returncode == 2 and "in use by another run" in second.stderr
        self.add(
            "a second run (1 rank, then 2 ranks) on a running dump folder",
            f"{second.returncode} in {second_s:.0f} s, {launched.returncode}; first {first.returncode}",
            f"{stop} (the first run's SIGTERM save)",
            equal(dump, self.losses1, 1, min(12, trained)) + ", first run undisturbed",
            ok and len(stop) == 1,
        )

    def corrupt(self, name: str, file: str, explicit: bool) -> None:
        dump = self.fresh(name, copy_of=self.ref1)
        (dump / "metrics.jsonl").write_text("")
        flip(dump / "checkpoints" / "step-000012" / file)
        args = ["--training.steps", "12", "--checkpoint.interval", "4"]
        if explicit:
            result = cli(dump, *args, "--checkpoint.load_step", "12")
            self.add(
                f"bytes flipped in {file}, load_step 12 asked for",
                str(result.returncode),
                f"{steps(dump)} untouched: '...{first_error(result, 'is corrupt: ')[:60]}'",
                "n/a (refused, one line)",
                result.returncode == 2 and "does not match its checksum" in result.stderr
                and "Traceback" not in result.stderr and steps(dump) == [4, 8, 12],
            )
            return
        result = cli(dump, *args)
        if file.startswith("rng-rank"):  # model and optimizer verify: resumed there, re-seeded (issue 27)
            self.add(
                f"bytes flipped in {file} of the newest, auto-resume",
                str(result.returncode),
                f"{steps(dump)}: warned, resumed step 12 re-seeded (nothing left to train)",
                "n/a",
                result.returncode == 0 and "step-000012 (step 12" in result.stdout and "re-seeded" in result.stdout,
            )
            return
        self.add(
            f"bytes flipped in {file} of the newest, auto-resume",
            str(result.returncode),
            f"{steps(dump)}: warned, resumed step 8, step 12 saved again",
            equal(dump, self.losses1, 9, 12),
            result.returncode == 0 and "step-000008 (step 8" in result.stdout and "skipping checkpoint" in result.stdout,
        )

    # ---- stops --------------------------------------------------------------------------------

    def sigterm(self, name: str, layout: list[str], launcher: list[str] | None, reference: dict,
                resume_layout: list[str]) -> None:  # fmt: skip
        dump = self.fresh(name)
        proc = start(dump, *layout, "--job.stop_grace_s", "120", launcher=launcher)
        try:
            wait_for_step(proc, 2)
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=200)
        finally:
            proc.kill()
        stop = steps(dump)
        status = exit_status(dump)
        saved_at_stop = len(stop) == 1 and stop[0] == max(losses(dump))
        resumed = cli(dump, *resume_layout, "--training.steps", "12") if saved_at_stop and stop[0] < 12 else None
        same = equal(dump, reference, stop[0] + 1, 12) if resumed is not None else "n/a (no save, or after step 12)"
        who = "torchrun --nproc-per-node 2" if launcher else ("plait-train --nproc-per-node 2" if layout else "1 process")
        self.add(
            f"SIGTERM to {who}",
            f"{proc.returncode} (exit_status {status}), resume {resumed.returncode if resumed else '-'}",
            f"{stop} (saved at the stop step)",
            same,
            saved_at_stop and status == "75" and (resumed is None or resumed.returncode == 0),
        )

    def sigterm_slow_save(self, grace_s: int, save_s: int) -> None:
        """SIGTERM to the launcher while the final save takes `save_s`: it must fit in the grace."""
        dump = self.fresh(f"grace{grace_s}")
        proc = start(dump, *TWO_RANKS, "--job.stop_grace_s", str(grace_s), env={"PLAIT_TEST_SLOW_SAVE_S": str(save_s)})
        try:
            wait_for_step(proc, 2)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=grace_s + 120)
            took = time.monotonic() - t0
        finally:
            proc.kill()
        saved = steps(dump)
        fits = grace_s > save_s
        # The stop message names the checkpoint a resume uses (issue 27), not only "resume".
        named = (f"resumes from {dump / 'checkpoints'}" in err) if saved else "no complete checkpoint" in err
        self.add(
            f"SIGTERM to plait-train --nproc-per-node 2, a {save_s} s save, stop_grace_s {grace_s}",
            f"{proc.returncode} after {took:.0f} s (exit_status {exit_status(dump)})",
            f"{saved}" + (" (saved at the stop step)" if fits else " (ranks SIGKILLed mid-save: nothing half-published)"),
            "n/a",
            proc.returncode == 75 and bool(saved) == fits and not unpublished_but_named(dump) and named,
        )

    def sigkill_launcher(self) -> None:
        dump = self.fresh("sigkill")
        proc = start(dump, *TWO_RANKS, "--checkpoint.interval", "2")
        try:
            wait_for_step(proc, 5)
            ranks = children(proc.pid)
            proc.kill()
            proc.wait(timeout=30)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30 and not all(gone(pid) for pid in ranks):
                time.sleep(0.1)
            died_s = time.monotonic() - t0
        finally:
            for pid in ranks:
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)
        orphans = [pid for pid in ranks if not gone(pid)]
        kept = steps(dump)
        resumed = cli(dump, *TWO_RANKS, "--training.steps", "12", "--checkpoint.interval", "2")
        self.add(
            "SIGKILL to plait-train --nproc-per-node 2",
            f"-9, resume {resumed.returncode}",
            f"{kept}; {len(ranks)} ranks gone in {died_s:.1f} s",
            equal(dump, self.losses2, kept[-1] + 1, 12),
            not orphans and len(ranks) == 2 and resumed.returncode == 0,
        )

    # ---- inputs -------------------------------------------------------------------------------

    def refused(self, fault: str, *args: str) -> None:
        dump = self.fresh(f"refused{len(self.rows)}")
        t0 = time.monotonic()
        result = cli(dump, "--training.steps", "4", *args)
        self.add(
            fault,
            f"{result.returncode} in {time.monotonic() - t0:.0f} s",
            f"none: '{first_error(result)[:70]}'",
            "n/a (refused before training)",
            result.returncode == 2 and "Traceback" not in result.stderr and not steps(dump),
        )

    # ---- issue 27: inputs trusted unchecked (defects 3-6, 8) ------------------------------------

    def hf_folder(self, name: str, damage: str) -> Path:
        """The debug model's weights as a Hugging Face folder, one tensor damaged: "fp8" (no
        scale), "int32", "nan", or "index" (the index names a file that lacks the tensor)."""
        code = """
import json, sys, torch
from safetensors.torch import save_file
from plait.models.hf import llama3 as a
from plait.models.llama3 import FLAVORS, Transformer
args = FLAVORS["debugmodel"]
torch.manual_seed(0)
m = Transformer(args); m.init_weights()
hf = {k: v.clone().contiguous() for k, v in a.to_hf(m.state_dict(), args).items()}
name, damage, out = "model.layers.0.self_attn.o_proj.weight", sys.argv[1], sys.argv[2]
if damage == "fp8": hf[name] = hf[name].to(torch.float8_e4m3fn)
if damage == "int32": hf[name] = hf[name].to(torch.int32)
if damage == "nan": hf[name][0, 0] = float("nan")
import os; os.makedirs(out)
save_file(hf, out + "/model.safetensors")
if damage == "index":
    wm = dict.fromkeys(hf, "model.safetensors"); wm["model.norm.weight"] = "model-00002.safetensors"
    save_file({"x": torch.zeros(1)}, out + "/model-00002.safetensors")
    json.dump({"weight_map": wm}, open(out + "/model.safetensors.index.json", "w"))
json.dump(a.hf_config(args), open(out + "/config.json", "w"))
"""
        out = self.root / name
        subprocess.run([sys.executable, "-c", code, damage, str(out)], check=True, env=ENV, timeout=120)
        return out

    def token_folder(self, name: str, damage: str) -> Path:
        """A pre-tokenised builtin corpus, damaged: "vocab" (an id past the vocabulary, recorded
        in meta.json as pretokenize does), "offsets" (two swapped), "size" (tokens.bin longer)."""
        import numpy as np

        out = self.root / name
        subprocess.run([sys.executable, "-m", "plait.data.pretokenize", "--dataset", "builtin", "--output",
                        str(out)], check=True, env=ENV, timeout=300, capture_output=True)  # fmt: skip
        meta = json.loads((out / "meta.json").read_text())
        if damage == "vocab":
            tokens = np.memmap(out / "tokens.bin", dtype=np.uint32, mode="r+")
            tokens[10] = 99_999
            tokens.flush()
            (out / "meta.json").write_text(json.dumps({**meta, "max_id": 99_999}))
        elif damage == "offsets":
            offsets = np.load(out / "offsets.npy")
            offsets[[5, 6]] = offsets[[6, 5]]
            np.save(out / "offsets.npy", offsets)
        elif damage == "size":
            with open(out / "tokens.bin", "ab") as f:
                f.write(b"\0" * 64)
        return out

    def pretokenize_output_file(self) -> None:
        target = self.root / "notes.txt"
        target.write_text("mine")
        result = subprocess.run([sys.executable, "-m", "plait.data.pretokenize", "--dataset", "builtin",
                                 "--output", str(target)], capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
        self.add(
            "plait-pretokenize --output naming an existing file",
            str(result.returncode),
            f"none: '{first_error(result)[:70]}'",
            "n/a (refused, file untouched)",
            result.returncode == 2 and "Traceback" not in result.stderr and target.read_text() == "mine",
        )

    def diverge_again(self) -> None:
        from plait.trainer.exit_codes import DIVERGED

        dump = self.fresh("nan_again")
        args = ["--training.steps", "8", "--optimizer.lr", "1e6", "--lr_scheduler.warmup_steps", "20000",
                "--metrics.log_freq", "20", "--checkpoint.interval", "2", "--checkpoint.keep_last", "3"]  # fmt: skip
        first = cli(dump, *args)
        again = cli(dump, *args)
        self.add(
            "NaN, then the same command again (resumes the last good step 4, diverges at once)",
            f"{first.returncode}, again {again.returncode}",
            f"{steps(dump)}; second error: '...{first_error(again, 'diverged again')[:60]}'",
            "n/a (points to --checkpoint.load_step 2)",
            first.returncode == again.returncode == DIVERGED and "diverged again" in again.stderr
            and "--checkpoint.load_step 2" in again.stderr,
        )

    # ---- issue 27: checkpoints (hf_export, damaged folders, model args, locks, stops, exit codes) ----

    def export_cli(self, checkpoint: Path, output: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "plait.trainer.checkpoint.hf_export", "--checkpoint",
                               str(checkpoint), "--output", str(output)], capture_output=True, text=True, env=ENV,
                              timeout=300)  # fmt: skip

    def checkpoints27(self) -> None:
        """One short 2-layer run (a checkpoint per step), then faults on copies of it."""
        tiny = ["--model.n_layers", "2", "--checkpoint.interval", "1"]
        base = self.fresh("ck27")
        self.check(cli(base, *tiny, "--training.steps", "2"), 0)

        def files(folder: Path) -> dict:
            return {str(f.relative_to(folder)): f.stat().st_size for f in folder.rglob("*")
                    if f.is_file() and f.name not in ("exit_status",)}

        for name, target in (("the run folder", lambda d: d), ("the checkpoint", lambda d: d / "checkpoints" / "step-000002")):
            dump = self.fresh(f"ck27_export_{len(self.rows)}", copy_of=base)
            before = files(dump)
            result = self.export_cli(dump / "checkpoints" / "step-000002", target(dump))
            self.add(f"hf_export --output {name}", str(result.returncode), f"{steps(dump)}, every file kept: "
                     f"'{result.stderr.strip().splitlines()[-1][18:80]}'", "n/a (refused)",
                     result.returncode == 2 and files(dump) == before and "Traceback" not in result.stderr)
        out = self.root / "ck27_hf"
        result = self.export_cli(base / "checkpoints" / "step-000002", out)
        layers = json.loads((out / "config.json").read_text())["num_hidden_layers"] if out.is_dir() else None
        self.add("hf_export of a --model.n_layers 2 checkpoint", str(result.returncode), f"config: {layers} layers",
                 "n/a", result.returncode == 0 and layers == 2)

        dump = self.fresh("ck27_rng", copy_of=base)
        for step in (1, 2):
            flip(dump / "checkpoints" / f"step-00000{step}" / "rng-rank00000.pt")
        result = cli(dump, *tiny, "--training.steps", "3")
        self.add("rng-rank00000.pt damaged in every checkpoint", str(result.returncode),
                 f"{steps(dump)}: resumed step 2, re-seeded (warned)", "n/a (RNG re-seeded)",
                 result.returncode == 0 and "step-000002 (step 2" in result.stdout and "re-seeded" in result.stdout)

        dump = self.fresh("ck27_all_bad", copy_of=base)
        for step in (1, 2):
            flip(dump / "checkpoints" / f"step-00000{step}" / "__0_0.distcp")
        before = files(dump)
        refused = cli(dump, *tiny, "--training.steps", "2")
        kept = files(dump) == before
        fresh = cli(dump, *tiny, "--training.steps", "2", "--checkpoint.allow_fresh_start", "true")
        rejected = sorted(p.name[:11] for p in (dump / "checkpoints").glob("step-*.rejected-*"))
        self.add("every checkpoint's data damaged; then --checkpoint.allow_fresh_start",
                 f"{refused.returncode}, then {fresh.returncode}", f"kept: {rejected} as .rejected-*",
                 "n/a (refused, then step 1 on request)",
                 refused.returncode == 2 and "allow_fresh_start" in refused.stderr and kept and fresh.returncode == 0
                 and len(rejected) == 2 and any(dump.glob("metrics.jsonl.replaced-*")))

        dump = self.fresh("ck27_args", copy_of=base)
        result = cli(dump, *tiny, "--training.steps", "3", "--model.rope_theta", "10000")
        self.add("resume with another --model.rope_theta", str(result.returncode), f"{steps(dump)} untouched",
                 "n/a (refused, one line)", result.returncode == 2 and "rope_theta 500000" in result.stderr)

        shared = self.root / "ck27_shared"
        first = start(self.fresh("ck27_a"), "--checkpoint.folder", str(shared), "--checkpoint.interval", "1")
        try:
            wait_for_step(first, 2)
            second = cli(self.fresh("ck27_b"), "--training.steps", "4", "--checkpoint.folder", str(shared))
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=120)
        finally:
            first.kill()
        self.add("a second run, another dump folder, the same checkpoint.folder", f"{second.returncode}; first "
                 f"{first.returncode}", "the first run's, untouched", "n/a (refused, one line)",
                 second.returncode == 2 and "checkpoint.folder" in second.stderr and first.returncode == 75)

    def rank_killed(self) -> None:
        """SIGKILL to rank 1 of plait-train --nproc-per-node 2 (the OOM killer): named, exit 74."""
        dump = self.fresh("rank_killed")
        proc = start(dump, *TWO_RANKS)
        try:
            wait_for_step(proc, 2)
            ranks = {}
            for pid in children(proc.pid):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
                if rank is not None:
                    ranks[rank] = pid
            os.kill(ranks[1], signal.SIGKILL)
            _, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        last = err.strip().splitlines()[-1] if err.strip() else ""
        self.add("SIGKILL to rank 1 of plait-train --nproc-per-node 2 (OOM killer)",
                 f"{proc.returncode} (exit_status {exit_status(dump)})", f"'{last[13:75]}'", "n/a",
                 proc.returncode == 74 and "rank 1 of 2 failed first" in last and exit_status(dump) == "74")

    def new_lr(self) -> None:
        dump = self.fresh("new_lr", copy_of=self.ref1)
        shutil.rmtree(dump / "checkpoints" / "step-000012")
        result = cli(dump, "--training.steps", "16", "--optimizer.lr", "1e-3", "--metrics.log_freq", "4")
        lrs = {row["step"]: row["lr"] for row in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}
        applied = all(lrs[s] == 1e-3 for s in range(9, 17))
        self.add(
            "resume step 8 with --optimizer.lr 1e-3 --training.steps 16",
            str(result.returncode),
            f"{steps(dump)}; lr 3e-3 -> 1e-3 printed",
            f"{'yes' if applied else 'NO'} (steps 9-16 at lr 1e-3)",
            result.returncode == 0 and "optimizer.lr 0.003 -> 0.001" in result.stdout and applied,
        )


# Groups of rows that run alone (`--only NAME[,NAME]`), without the reference runs.
ONLY = {
    "checkpoints27": lambda m: m.checkpoints27(),
    "rank_killed": lambda m: m.rank_killed(),
    "grace": lambda m: m.sigterm_slow_save(grace_s=5, save_s=20),
}


def table(m: "Matrix", t0: float, root: Path) -> int:
    print(f"\n{len(m.rows)} faults in {time.monotonic() - t0:.0f} s\n")
    print("| fault | exit code | checkpoints after | resumed loss equal | good state kept |")
    print("| --- | --- | --- | --- | --- |")
    for r in m.rows:
        print(f"| {r.fault} | {r.exit_codes} | {r.checkpoints} | {r.resumed_equal} | {'yes' if r.good_state_kept else 'NO'} |")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.good_state_kept for r in m.rows) else 1


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="plait-reliability-"))
    t0 = time.monotonic()
    print(f"fault matrix in {root}", flush=True)
    if "--only" in sys.argv:
        names = sys.argv[sys.argv.index("--only") + 1].split(",")
        unknown = [n for n in names if n not in ONLY]
        if unknown:
            sys.exit(f"--only: unknown {unknown}; choose from {', '.join(ONLY)}")
        m = Matrix(root, references=False)
        for name in names:
            ONLY[name](m)
        return table(m, t0, root)
    m = Matrix(root)
    m.nan()
    m.timeline()
    m.lock()
    m.corrupt("corrupt_data", "__0_0.distcp", explicit=False)
    m.corrupt("corrupt_data_explicit", "__0_0.distcp", explicit=True)
    m.corrupt("corrupt_rng", "rng-rank00000.pt", explicit=False)
    m.corrupt("corrupt_metadata", ".metadata", explicit=False)
    m.sigterm("sigterm1", [], None, m.losses1, [])
    m.sigterm("sigterm2", TWO_RANKS, None, m.losses2, TWO_RANKS)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--shutdown-timeout", "120", "-m", "plait.trainer"]  # fmt: skip
    m.sigterm("sigterm_torchrun", ["--training.local_batch_size", "1"], torchrun, m.losses2, TWO_RANKS)
    m.sigterm_slow_save(grace_s=60, save_s=20)
    m.sigterm_slow_save(grace_s=5, save_s=20)  # what torch elastic's fixed 30 s did to larger saves
    m.sigkill_launcher()
    ro = root / "a_file"
    ro.write_text("")
    m.refused("dump folder is a file", "--job.dump_folder", str(ro / "run"))
    m.refused("--optimizer.lr nan", "--optimizer.lr", "nan")
    m.refused("--training.max_norm inf", "--training.max_norm", "inf")
    m.new_lr()
    # issue 27: inputs trusted unchecked
    hf = ["--checkpoint.initial_load_hf", "true", "--checkpoint.initial_load_path"]
    m.refused("HF import: FP8 o_proj without weight_scale_inv", *hf, str(m.hf_folder("hf_fp8", "fp8")))
    m.refused("HF import: int32 o_proj", *hf, str(m.hf_folder("hf_int32", "int32")))
    m.refused("HF import: NaN in o_proj", *hf, str(m.hf_folder("hf_nan", "nan")))
    m.refused("HF import: index names a file lacking the tensor", *hf, str(m.hf_folder("hf_index", "index")))
    tokens = ["--data.dataset", "tokens", "--data.dataset_path"]
    m.refused("tokens folder: id 99999 >= vocab 2048", *tokens, str(m.token_folder("tok_vocab", "vocab")))
    m.refused("tokens folder: offsets going backwards", *tokens, str(m.token_folder("tok_offsets", "offsets")))
    m.refused("tokens folder: tokens.bin longer than meta.json says", *tokens, str(m.token_folder("tok_size", "size")))
    m.pretokenize_output_file()
    m.refused("deepseek_v3 debugmodel (softmax) with checkpoint.last_save_in_hf", "--model.name", "deepseek_v3",
              "--checkpoint.last_save_in_hf", "true")
    for field, value in (("dim", "0"), ("n_layers", "0"), ("n_kv_heads", "0"), ("rope_theta", "-1"),
                         ("norm_eps", "-1e-5")):
        m.refused(f"--model.{field} {value}", f"--model.{field}", value)
    m.refused("--model.n_activated_experts 0 (deepseek_v3)", "--model.name", "deepseek_v3",
              "--model.n_activated_experts", "0")
    m.refused("--data.prefetch 100000", "--data.prefetch", "100000")
    m.refused("--parallelism.expert_capacity_factor -1 at ep 1", "--parallelism.expert_capacity_factor", "-1")
    m.diverge_again()
    # issue 27: checkpoints, locks, stops and exit codes
    m.checkpoints27()
    m.rank_killed()
    return table(m, t0, root)


if __name__ == "__main__":
    sys.exit(main())
