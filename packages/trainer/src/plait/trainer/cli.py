"""`plait-train`: parse the config, validate it, then train here or launch N local ranks.

    plait-train                                   # Llama 3 debug model, shipped corpus, short run
    plait-train --config llama3_8B.toml --training.steps 1000
    plait-train --nproc-per-node 2 --training.local_batch_size 4
    torchrun --nproc-per-node 8 -m plait.trainer --config llama3_8B.toml

Exit codes (exit_codes.py; schedulers requeue on 74 and 75 only): 0 finished, 1 unexpected error (a
bug, with its traceback; a collective mismatch between ranks), 2 configuration or checkpoint error,
3 diverged, 4 out of memory (the same config runs out again), 5 a requeue-able failure at the same
step as the previous run's (the cause is the run's: not requeued again), 74 infrastructure fault
(I/O, a rank died or was killed, a lost peer, a collective timeout), 75 stopped before its last step
(SIGTERM), 130 interrupted (Ctrl-C). The code is also written to <job.dump_folder>/exit_status,
since torchrun turns a rank's code into 1.
"""

import difflib
import os
import signal
import sys
from dataclasses import dataclass, field

from . import exit_codes
from .config import ConfigError, all_keys, build_config, help_text, load_toml, shipped_configs, to_toml

USAGE = """usage: plait-train [--config FILE.toml] [--print-config] [--nproc-per-node N] [--section.key VALUE ...]

Train a plait model. Settings come from the defaults below, then --config (a path, or the name
of a shipped config: {shipped}; default llama3_debugmodel.toml), then --section.key VALUE
overrides in order.

  --config FILE         TOML file with [job], [model], [data], ... sections
  --print-config        print the effective configuration as TOML and exit
  --nproc-per-node N    start N local ranks with torch's elastic launcher (python -m plait.trainer)
  -h, --help            this help

Multi-node: torchrun --nnodes ... --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m plait.trainer ...

Settings (--section.key VALUE or --section.key=VALUE; booleans alone mean true):
"""

EXIT_FINISHED, EXIT_DIVERGED, EXIT_CONFIG = exit_codes.FINISHED, exit_codes.DIVERGED, exit_codes.CONFIG
EXIT_STOPPED, EXIT_INTERRUPTED = exit_codes.STOPPED, exit_codes.INTERRUPTED
EXIT_INFRA, EXIT_ERROR = exit_codes.INFRA, exit_codes.ERROR
EXIT_OOM, EXIT_REPEATED = exit_codes.OUT_OF_MEMORY, exit_codes.REPEATED

# What `plait-train` with no --config runs: the Llama 3 debug model on the shipped corpus.
DEFAULT_CONFIG = "llama3_debugmodel.toml"

_OPTIONS = ["--config", "--print-config", "--nproc-per-node", "--help"]


@dataclass
class Args:
    config: str | None = None
    print_config: bool = False
    help: bool = False
    nproc_per_node: int = 1
    overrides: list[tuple[str, str]] = field(default_factory=list)
    forward: list[str] = field(default_factory=list)  # argv for the ranks (without --nproc-per-node)


def _is_value(token: str) -> bool:
    if not token.startswith("--"):
        return True
    try:  # a negative number is a value
        float(token)
        return True
    except ValueError:
        return False


def parse_args(argv: list[str]) -> Args:
    args = Args()
    bool_keys = _bool_keys()
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        has_next = i + 1 < len(argv) and _is_value(argv[i + 1])
        given = inline if eq else (argv[i + 1] if has_next else None)
        consumed = 1 if eq else 2
        if name in ("-h", "--help"):
            args.help, consumed = True, 1
        elif name == "--print-config":
            args.print_config, consumed = True, 1
        elif name == "--config":
            args.config = _need(name, given)
        elif name in ("--nproc-per-node", "--nproc_per_node"):
            raw = _need(name, given)
            try:
                args.nproc_per_node = int(raw)
            except ValueError:
                raise ConfigError(f"--nproc-per-node {raw!r}: expected a number of ranks.") from None
            if args.nproc_per_node < 1:
                raise ConfigError("--nproc-per-node must be >= 1.")
            i += consumed
            continue  # not forwarded
        elif name.startswith("--") and "." in name:
            key = name[2:]
            if not eq and not has_next and key in bool_keys:
                args.overrides.append((key, "true"))
                consumed = 1
            else:
                args.overrides.append((key, _need(name, given)))
        elif name.startswith("-"):
            close = difflib.get_close_matches(name, _OPTIONS + [f"--{k}" for k in all_keys()], n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]}?" if close else " See plait-train --help."
            raise ConfigError(f"unknown option {name!r}.{hint}")
        else:
            raise ConfigError(f"unexpected argument {token!r}: settings are given as --section.key VALUE.")
        args.forward.extend(argv[i : i + consumed])
        i += consumed
    return args


def _need(flag: str, value: str | None) -> str:
    if value is None:
        raise ConfigError(f"{flag} needs a value.")
    return value


def _bool_keys() -> set[str]:
    import typing
    from dataclasses import fields

    from .config import SECTIONS

    keys = set()
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        keys.update(f"{section}.{f.name}" for f in fields(cls) if hints[f.name] is bool)
    return keys


def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def launch(nproc: int, forward: list[str], stop_grace_s: int, config=None) -> int:
    """Start `nproc` local ranks of `python -m plait.trainer <forward>` with torch's elastic launcher.

    On SIGTERM the launcher forwards it to the ranks (which finish their step and save) and waits
    `stop_grace_s` for them before SIGKILL (torch's default of 30 s cuts off large saves).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Local ranks talk over loopback; interface discovery can pick an unroutable one in containers.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--shutdown-timeout={stop_grace_s}", "--module",
         "plait.trainer", *forward]
    )  # fmt: skip
    import time

    started = time.time()
    try:
        run(launcher_args)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        if all(code == EXIT_STOPPED for code in codes.values()):
            print(f"plait-train: {_stopped_message(config)}", file=sys.stderr)
            return EXIT_STOPPED
        timestamps = {rank: failure.timestamp for rank, failure in e.failures.items()}
        notes = {}
        if config is not None:
            from .rank_notes import read_notes

            notes = read_notes(config.job.dump_folder, since=started)
        summary, code = failure_summary(codes, timestamps, nproc, notes,
                                        config.job.collective_timeout_s if config is not None else None)
        print(f"plait-train: {summary}", file=sys.stderr)
        return code
    except SignalException as e:
        if e.sigval == signal.SIGINT:  # Ctrl-C: the user stopped it, not a preemption to requeue
            print("plait-train: interrupted.", file=sys.stderr)
            return EXIT_INTERRUPTED
        # The ranks got the signal too and stopped after their step (and its checkpoint); the run
        # did not finish its steps, so a scheduler must see a failure and requeue it.
        print(f"plait-train: stopped by signal {e.sigval}; {_stopped_message(config)}", file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_FINISHED


def _how(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {"SIGKILL": ": the OOM killer, or killed by hand", "SIGSEGV": ": a crash in native code",
               "SIGBUS": ": a memory / filesystem fault"}.get(name, "")
        return f"was killed by {name}{why}"
    meaning = {EXIT_ERROR: "an unexpected error (traceback above)", EXIT_CONFIG: "a configuration or checkpoint error",
               EXIT_DIVERGED: "diverged", EXIT_INFRA: "an infrastructure fault", EXIT_STOPPED: "stopped (SIGTERM)",
               EXIT_OOM: "out of memory", EXIT_REPEATED: "the previous run's failure again",
               EXIT_INTERRUPTED: "interrupted"}
    return f"exited {code} ({meaning.get(code, 'see its output above')})"


# How likely a rank's ending is the cause rather than a consequence of another rank's: the
# launcher SIGTERMs the survivors (-15, or 75 when they stop cleanly), and their collectives
# fail with a lost peer (74) once one rank is gone.
def _consequence(code: int) -> int:
    return {-int(signal.SIGTERM): 4, EXIT_STOPPED: 3, EXIT_INFRA: 2}.get(code, 0 if code < 0 else 1)


def failure_summary(codes: dict[int, int], timestamps: dict[int, int], nproc: int, notes: dict | None = None,
                    timeout_s: float | None = None) -> tuple[str, int]:
    """One line naming the rank that failed first and how, the others after it, and the code the
    launcher exits with: the first rank's own, or 74 (infrastructure) for a rank killed by a signal.

    `notes` (rank_notes: what each failing rank noted) tell a stall from a crash: when ranks timed
    out in a collective and a rank that noted nothing was killed by the launcher afterwards, that
    rank is the one they waited on (a stopped or hung process), not a victim of the OOM killer."""
    from .rank_notes import TIMEOUT

    notes = notes or {}
    waited = sorted(r for r, note in notes.items() if note.get("cause") == TIMEOUT)
    silent = sorted(r for r, c in codes.items() if c < 0 and r not in notes)
    if waited and silent:
        step = notes[waited[0]].get("step")
        after = f" after {timeout_s:g} s (job.collective_timeout_s)" if timeout_s else ""
        others = ", ".join(f"rank {r}" for r in waited)
        killed = ", ".join(f"rank {r} by {_signal_name(codes[r])}" for r in silent)
        return (f"rank {silent[0]} of {nproc} stalled: {others} timed out at step {step}{after} waiting in a "
                f"collective it never joined (a stopped or hung process, a lost node); the launcher then killed "
                f"{killed}. plait-train exits {EXIT_INFRA} (requeue)."), EXIT_INFRA
    first = min(codes, key=lambda r: (timestamps.get(r, 0), _consequence(codes[r]), r))
    code = codes[first]
    exit_code = EXIT_INFRA if code < 0 else code

    def how(r: int) -> str:
        if r != first and codes[r] < 0 and timestamps.get(r, 0) > timestamps.get(first, 0):
            return f"was killed by {_signal_name(codes[r])} (by the launcher, after rank {first} failed)"
        return _how(codes[r])

    others = ", ".join(f"rank {r} {how(r).split(' (')[0]}" for r in sorted(codes) if r != first)
    then = f"; then {others}" if others else ""
    return (f"rank {first} of {nproc} failed first: it {_how(code)}{then}. plait-train exits {exit_code}"
            f"{' (requeue)' if exit_code in exit_codes.REQUEUE else ''}."), exit_code


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _stopped_message(config=None) -> str:
    """Which checkpoint the same command resumes from, read from the folder (the stop's own save
    may have been cut off by the grace running out, so this is not assumed)."""
    stopped = f"the run stopped before its last step (exit {EXIT_STOPPED})"
    if config is None:
        return f"{stopped}: run the same command to resume."
    from pathlib import Path

    from plait.checkpoint import store

    c = config.checkpoint
    if not c.enable:
        return f"{stopped}; checkpoint.enable is false, so the same command trains again from step 1."
    folder = Path(config.job.dump_folder) / c.folder
    if c.load_step >= 0:
        return f"{stopped}; the same command resumes from checkpoint.load_step = {c.load_step} ({folder})."
    try:
        path, meta, _ = store.newest_complete(folder)
    except OSError:
        path = meta = None
    if path is None:
        return f"{stopped}; no complete checkpoint in {folder}: the same command trains again from step 1."
    return f"{stopped}; the same command resumes from {path} (step {meta['step']}), the newest complete checkpoint."


def _launch_holding_the_lock(config, nproc: int, forward: list[str]) -> int:
    """The launcher holds the dump folder's lock for its ranks (they see PLAIT_RUN_LOCK and skip it)."""
    from .run_lock import HELD_BY_LAUNCHER, RunLock

    lock = RunLock(config.job.dump_folder)
    warning = lock.acquire()
    if warning:
        print(f"plait-train: warning: {warning}", file=sys.stderr)
    os.environ[HELD_BY_LAUNCHER] = str(lock.path)
    code = EXIT_ERROR  # if launch itself raises
    try:
        code = launch(nproc, forward, config.job.stop_grace_s, config)
    finally:
        code = lock.release(code)
    if lock.why:
        print(f"plait-train: {lock.why}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep instead of spinning.
    # Spinning threads starve each other whenever the cores are shared (other ranks, other jobs),
    # which can make a CPU step 10x slower; set OMP_WAIT_POLICY=ACTIVE to get spinning back.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if _under_launcher():
        from .launcher_watch import die_with_launcher

        die_with_launcher()
    from torch.distributed.checkpoint.api import CheckpointException

    from .train import TrainingDiverged, infrastructure_fault, out_of_memory

    try:
        args = parse_args(argv)
        if args.help:
            from .config import help_text

            print(USAGE.format(shipped=", ".join(shipped_configs())) + help_text())
            return 0
        config = build_config(load_toml(args.config or DEFAULT_CONFIG), args.overrides)
        if args.print_config:
            from .validate import model_args_dict, resolve_model_args

            print(to_toml(config, with_docs=True, model_args=model_args_dict(resolve_model_args(config))))
            return 0
        if args.nproc_per_node > 1 and not _under_launcher():
            from .validate import validate

            validate(config, world_size=args.nproc_per_node, check_memory=True)  # fail here, before any rank starts
            return _launch_holding_the_lock(config, args.nproc_per_node, args.forward)
        from .train import run

        finished = run(config)
        if not finished and os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"plait-train: {_stopped_message(config)}", file=sys.stderr)
        return EXIT_FINISHED if finished else EXIT_STOPPED
    except ConfigError as e:
        print(f"plait-train: error: {e}", file=sys.stderr)
        _status_before_the_lock(locals().get("config"), EXIT_CONFIG)
        return EXIT_CONFIG
    except CheckpointException as e:
        # DCP's failure type derives from BaseException (it would escape `except Exception`).
        print(f"plait-train: error: checkpoint: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}",
              file=sys.stderr)  # fmt: skip
        return _code(e, EXIT_CONFIG)
    except TrainingDiverged as e:
        if os.environ.get("RANK", "0") == "0":  # the same on every rank (losses are all-reduced)
            print(f"plait-train: error: {e}", file=sys.stderr)
        return _code(e, EXIT_DIVERGED)
    except KeyboardInterrupt:
        print("plait-train: interrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except exit_codes.InfrastructureFault as e:  # the same on every rank (a save fails on all)
        code = _code(e, EXIT_INFRA)
        if os.environ.get("RANK", "0") == "0":
            print(f"plait-train: error: {e} ({_requeue(e, code)})", file=sys.stderr)
        return code
    except (OSError, MemoryError, RuntimeError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        rank = os.environ.get("RANK", "0")
        if out_of_memory(e):
            print(f"plait-train: error: rank {rank}: out of memory: {type(e).__name__}: {text[:200]}; the same "
                  "config runs out again: lower training.local_batch_size or seq_len, set "
                  "training.activation_checkpoint = full, or shard more (plait-plan shows the peak) "
                  f"(exit {EXIT_OOM}: not requeued)", file=sys.stderr)  # fmt: skip
            return _code(e, EXIT_OOM)
        if not infrastructure_fault(e):
            raise  # a bug: its traceback, exit 1
        code = _code(e, EXIT_INFRA)
        print(f"plait-train: error: rank {rank}: infrastructure fault: {type(e).__name__}: "
              f"{text[:300]} ({_requeue(e, code)})", file=sys.stderr)
        return code


def _code(error: BaseException, default: int) -> int:
    """The code the run settled on (train.run: a repeat of the previous run's failure is 5)."""
    return getattr(error, "plait_exit_code", default)


def _requeue(error: BaseException, code: int) -> str:
    return getattr(error, "plait_exit_why", "") or f"exit {code}: requeue"


def _status_before_the_lock(config, code: int) -> None:
    """A configuration error can come before any lock was taken: write exit_status anyway (rank 0,
    not under the plait launcher, whose own line covers it), unless another live run holds the folder."""
    from .run_lock import HELD_BY_LAUNCHER, RunLock

    if config is None or os.environ.get("RANK", "0") != "0" or os.environ.get(HELD_BY_LAUNCHER):
        return
    from pathlib import Path

    from . import exit_codes

    # Only over an earlier run's status (a requeued job's): never a new file in a folder that is
    # not yet a run's (an empty job.dump_folder is the current directory).
    if not config.job.dump_folder or not (Path(config.job.dump_folder) / exit_codes.STATUS_FILE).is_file():
        return

    RunLock(config.job.dump_folder).write_status_if_free(code)


__all__ = ["main", "parse_args", "help_text"]
