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
import sys
from dataclasses import dataclass, field

from . import exit_codes
from .config import ConfigError, all_keys, build_config, help_text, load_toml, shipped_configs, to_toml
from .launch import (
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_FINISHED,
    EXIT_INFRA,
    EXIT_INTERRUPTED,
    EXIT_OOM,
    EXIT_STOPPED,
    launch_holding_the_lock,
    rank_factory,
    stopped_message,
)
from .log import EVERY_RANK, cli_log

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep instead of spinning.
    # Spinning threads starve each other whenever the cores are shared (other ranks, other jobs),
    # which can make a CPU step 10x slower; set OMP_WAIT_POLICY=ACTIVE to get spinning back.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .quiet import quiet_known_noise

    quiet_known_noise()
    if _under_launcher():
        from .launcher_watch import die_with_launcher, name_process

        die_with_launcher()
        name_process(f"plait-rank{os.environ.get('RANK', '')}")  # how tests and users find a rank
    built: list = []  # the config, once built (a config error writes exit_status only then)
    try:
        return _main(argv, built)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        code = _exit_for(e, built[0] if built else None)
        if code is None:
            raise  # a bug: its traceback, exit 1
        return code


def _main(argv: list[str], built: list) -> int:
    args = parse_args(argv)
    if args.help:
        print(USAGE.format(shipped=", ".join(shipped_configs())) + help_text())
        return 0
    config = build_config(load_toml(args.config or DEFAULT_CONFIG), args.overrides)
    built.append(config)
    if args.print_config:
        from plait.models import model_args_dict

        from .model_args import resolve_model_args

        print(to_toml(config, with_docs=True, model_args=model_args_dict(resolve_model_args(config))))
        return 0
    if args.nproc_per_node > 1 and not _under_launcher():
        from .validate import validate

        factory = rank_factory(config)
        try:
            validate(config, world_size=args.nproc_per_node, check_memory=True)  # fail here, before any rank starts
            return launch_holding_the_lock(config, args.nproc_per_node, args.forward, factory)
        finally:
            if factory is not None:
                factory.close()
    from .train import run

    finished = run(config)
    if not finished and os.environ.get("LOCAL_RANK", "0") == "0":
        cli_log.info(stopped_message(config))
    return EXIT_FINISHED if finished else EXIT_STOPPED


def _exit_for(e: BaseException, config) -> int | None:
    """The one line and the exit code of an error that ends plait-train; None: a bug (re-raise)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .failures import TrainingDiverged, infrastructure_fault, out_of_memory

    if isinstance(e, ConfigError):
        cli_log.error(e)
        _status_before_the_lock(config, EXIT_CONFIG)
        return EXIT_CONFIG
    if isinstance(e, CheckpointException):
        cli_log.error(f"checkpoint: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}")
        return _code(e, EXIT_CONFIG)
    if isinstance(e, TrainingDiverged):
        cli_log.error(e)  # rank 0's: the same on every rank (losses are all-reduced)
        return _code(e, EXIT_DIVERGED)
    if isinstance(e, KeyboardInterrupt):
        cli_log.info("interrupted.")
        return EXIT_INTERRUPTED
    if isinstance(e, exit_codes.InfrastructureFault):  # the same on every rank (a save fails on all)
        code = _code(e, EXIT_INFRA)
        cli_log.error(f"{e} ({_requeue(e, code)})")
        return code
    if not isinstance(e, (OSError, MemoryError, RuntimeError)):
        return None
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if out_of_memory(e):
        cli_log.error(f"out of memory: {type(e).__name__}: {text[:200]}; the same config runs out again: lower "
                      "training.local_batch_size or seq_len, set training.activation_checkpoint = full, or shard "
                      f"more (plait-plan shows the peak) (exit {EXIT_OOM}: not requeued)", extra=EVERY_RANK)
        return _code(e, EXIT_OOM)
    if not infrastructure_fault(e):
        return None
    code = _code(e, EXIT_INFRA)
    cli_log.error(f"infrastructure fault: {type(e).__name__}: {text[:300]} ({_requeue(e, code)})", extra=EVERY_RANK)
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
