"""`plait-train --nproc-per-node N`: start N local ranks with torch's elastic launcher, holding
the dump folder's lock for them, and turn their exit codes into one line and one code."""

import os
import signal

from . import exit_codes
from .log import cli_log
from .rank_factory import client_command

EXIT_FINISHED, EXIT_DIVERGED, EXIT_CONFIG = exit_codes.FINISHED, exit_codes.DIVERGED, exit_codes.CONFIG
EXIT_STOPPED, EXIT_INTERRUPTED = exit_codes.STOPPED, exit_codes.INTERRUPTED
EXIT_INFRA, EXIT_ERROR = exit_codes.INFRA, exit_codes.ERROR
EXIT_OOM, EXIT_REPEATED = exit_codes.OUT_OF_MEMORY, exit_codes.REPEATED


def launch(nproc: int, forward: list[str], stop_grace_s: int, config=None, factory=None) -> int:
    """Start `nproc` local ranks of `python -m plait.trainer <forward>` with torch's elastic launcher,
    forked from `factory` (rank_factory(): then the agent starts each rank's client) or spawned.

    On SIGTERM the launcher forwards it to the ranks (which finish their step and save) and waits
    `stop_grace_s` for them before SIGKILL (torch's default of 30 s cuts off large saves).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Local ranks talk over loopback; interface discovery can pick an unroutable one in containers.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from .quiet import one_openmp_thread_per_rank

    one_openmp_thread_per_rank()
    # Each restart gets a store of its own (torch's shared one let restarted ranks read the previous
    # attempt's gloo addresses: plait.mesh.elastic_problem).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rank_command = ["--no-python", *client_command()] if factory else ["--module", "plait.trainer"]
    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--shutdown-timeout={stop_grace_s}", *rank_command, *forward]
    )  # fmt: skip
    import time

    started = time.time()
    try:
        run(launcher_args)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        if all(code == EXIT_STOPPED for code in codes.values()):
            cli_log.info(stopped_message(config))
            return EXIT_STOPPED
        timestamps = {rank: failure.timestamp for rank, failure in e.failures.items()}
        notes = {}
        if config is not None:
            from .rank_notes import read_notes

            notes = read_notes(config.job.dump_folder, since=started)
        summary, code = failure_summary(codes, timestamps, nproc, notes,
                                        config.job.collective_timeout_s if config is not None else None)
        cli_log.info(summary)
        return code
    except SignalException as e:
        if e.sigval == signal.SIGINT:  # Ctrl-C: the user stopped it, not a preemption to requeue
            cli_log.info("interrupted.")
            return EXIT_INTERRUPTED
        # The ranks got the signal too and stopped after their step (and its checkpoint); the run
        # did not finish its steps, so a scheduler must see a failure and requeue it.
        cli_log.info(f"stopped by signal {e.sigval}; {stopped_message(config)}")
        return EXIT_STOPPED
    return EXIT_FINISHED


def rank_factory(config):
    """The rank factory the ranks will be forked from (rank_factory.py), or None: spawned ranks
    (job.rank_start = spawn, or auto where forking is not safe). Made before the launcher validates
    the run (whose threads a fork would not carry): the factory imports while the launcher checks."""
    from .rank_factory import RankFactory, fork_problem

    start = config.job.rank_start
    if start == "spawn":
        return None
    problem = fork_problem()
    if problem is not None:
        if start == "fork":
            cli_log.warning(f"job.rank_start = fork: spawning the ranks instead: {problem}.")
        return None
    factory = RankFactory()
    os.environ.update(factory.env())  # the agent passes the launcher's environment to each rank's client
    return factory


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


def stopped_message(config=None) -> str:
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


def launch_holding_the_lock(config, nproc: int, forward: list[str], factory=None) -> int:
    """The launcher holds the dump folder's lock for its ranks (they see PLAIT_RUN_LOCK and skip it)."""
    from .run_lock import HELD_BY_LAUNCHER, RunLock

    lock = RunLock(config.job.dump_folder)
    warning = lock.acquire()
    if warning:
        cli_log.warning(warning)
    os.environ[HELD_BY_LAUNCHER] = str(lock.path)
    code = EXIT_ERROR  # if launch itself raises
    try:
        code = launch(nproc, forward, config.job.stop_grace_s, config, factory)
    finally:
        code = lock.release(code)
    if lock.why:
        cli_log.info(lock.why)
    return code
