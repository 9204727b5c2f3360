"""`plait-plan`: what one rank of a layout holds, sends and computes per step, before the run.

    plait-plan --config deepseek_v3_671B.toml --plan.world_size 512
    plait-plan --config llama3_8B.toml --plan.world_size 64 --parallelism.tp 8 --plan.device h200
    plait-plan --config llama3_debugmodel.toml --plan.world_size 2 --parallelism.dp_shard 2 --plan.json plan.json

The config and every --section.key flag are plait-train's, validated by the same code (same
one-line errors, exit 2), except that no tokenizer file or dataset is read: a plan needs only the
model's vocab_size. The step is traced through the device's kernel routes (a GPU's bf16 products
and attention), whatever the CPU planning it. The --plan.* flags are the planner's own:

  --plan.world_size N         ranks of the run (default: the product of the configured degrees;
                              at most 1,048,576)
  --plan.device h100|h200     device whose peak, memory, links and kernels the step is read against (h100)
  --plan.device_memory_gib G  memory per device (default: the device's)
  --plan.document_tokens N    mean document length under model.attention_mask = "document": rows of
                              seq_len / N documents are traced (default: a pre-tokenised folder's mean,
                              read from its meta.json, else 2048; one document per row for a causal mask)
  --plan.json PATH            also write the plan as JSON (checked writable before the trace)
  --plan.search               list the layouts that fit --plan.world_size, fewest bytes per token first,
                              each as plait-train flags (plan/search.py)
  --plan.search_limit N       layouts the search traces at most (default 12)
  --plan.max_batch            for the config's layout, each AC mode's largest training.local_batch_size
                              that fits (traced: doubling, then bisection), tokens per GPU per step,
                              and the one recommended (plan/max_batch.py); not with --plan.search

plait-plan starts no ranks: --nproc-per-node is refused (the plan's world is --plan.world_size).
"""

import json
import math
import os
import sys

from plait.trainer import exit_codes
from plait.trainer.config import ConfigError

from .planning import PlanArgs, check_world_size, make_plan  # noqa: F401  (PlanArgs: read here by benchmarks)

PLAN_KEYS = ("world_size", "device", "device_memory_gib", "document_tokens", "json", "search", "search_limit",
             "max_batch")
FLAGS = ("search", "max_batch")  # --plan.search alone means true


def split_plan_args(argv: list[str]) -> tuple[PlanArgs, list[str]]:
    """The --plan.* flags, and the rest for plait-train's parser."""
    plan, rest, i = PlanArgs(), [], 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if not name.startswith("--plan."):
            rest.append(argv[i])
            i += 1
            continue
        key = name[len("--plan."):]
        if key not in PLAN_KEYS:
            raise ConfigError(f"unknown option {name!r}: plait-plan takes {', '.join('--plan.' + k for k in PLAN_KEYS)}.")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        if key in FLAGS and not eq:
            value = argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in ("true", "false") else None
            setattr(plan, key, value != "false")
            i += 2 if value else 1
            continue
        if value is None:
            raise ConfigError(f"{name} needs a value.")
        i += 1 if eq else 2
        _set_plan_value(plan, key, name, value)
    if plan.world_size:
        check_world_size(plan.world_size)
    if plan.max_batch:
        from .max_batch import check_max_batch_args

        check_max_batch_args(plan)
    return plan, rest


def _set_plan_value(plan: PlanArgs, key: str, name: str, value: str) -> None:
    """One --plan.KEY VALUE into `plan`, or a one-line error naming what it expects."""
    from .devices import DEVICES

    try:
        if key == "world_size":
            plan.world_size = int(value)
            if plan.world_size < 1:
                raise ValueError
        elif key == "document_tokens":
            plan.document_tokens = int(value)
            if plan.document_tokens < 1:
                raise ValueError
        elif key in FLAGS:
            if value not in ("true", "false"):
                raise ValueError
            setattr(plan, key, value == "true")
        elif key == "search_limit":
            plan.search_limit = int(value)
            if plan.search_limit < 1:
                raise ValueError
        elif key == "device_memory_gib":
            plan.device_memory_gib = float(value)
            if not (math.isfinite(plan.device_memory_gib) and plan.device_memory_gib > 0):
                raise ValueError
        elif key == "device":
            if value.lower() not in DEVICES:
                raise ValueError
            plan.device = value.lower()
        else:
            plan.json = value
    except ValueError:
        expected = {"world_size": "a number of ranks >= 1", "device_memory_gib": "a finite number of GiB > 0",
                    "document_tokens": "a number of tokens >= 1",
                    "search": "true or false", "max_batch": "true or false", "search_limit": "a number of layouts >= 1",
                    "device": " or ".join(DEVICES)}[key]
        raise ConfigError(f"{name} = {value!r}: expected {expected}.") from None


def check_json_path(path: str) -> None:
    """--plan.json can be written (opened for appending, as the write will; a file made here is removed)."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"--plan.json = {path!r}: cannot write it ({e.strerror or e}).") from None
    if not existed:
        os.remove(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import warnings

    # DTensor's random ops on a CPU mesh: the fake step draws no numbers that matter.
    warnings.filterwarnings("ignore", message="DTensor random operators")
    import logging

    # "2 sequential all_reduce operations" for a 2-D gradient norm: counted in the plan already.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # The FakeTensor step's data_ptr reads (--plan.search): torch's own code, nothing to act on.
    warnings.filterwarnings("ignore", message=".*[Aa]ccessing (the )?data pointer of FakeTensor.*")
    from plait.trainer.cli import DEFAULT_CONFIG, parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.quiet import quiet_known_noise

    quiet_known_noise()

    try:
        if any(a in ("-h", "--help") for a in argv):
            print(__doc__)
            return exit_codes.FINISHED
        plan_args, rest = split_plan_args(argv)
        launcher = next((a for a in rest if a.partition("=")[0] in ("--nproc-per-node", "--nproc_per_node")), None)
        if launcher:
            raise ConfigError(f"{launcher.partition('=')[0]}: plait-plan starts no ranks; the plan's world is "
                              "--plan.world_size N (default: the product of the configured degrees).")
        args = parse_args(rest)
        if plan_args.json:
            check_json_path(plan_args.json)
        config = build_config(load_toml(args.config or DEFAULT_CONFIG), args.overrides)
        text, data = _run(config, plan_args)
    except ConfigError as e:
        print(f"plait-plan: error: {e}", file=sys.stderr)
        return exit_codes.CONFIG
    print(text)
    if plan_args.json:
        try:
            with open(plan_args.json, "w") as f:
                json.dump(data, f, indent=1)
        except OSError as e:  # checked before the trace; a disk that filled since
            print(f"plait-plan: error: --plan.json = {plan_args.json!r}: {e.strerror or e}", file=sys.stderr)
            return exit_codes.CONFIG
    return exit_codes.FINISHED


def _run(config, plan_args) -> tuple[str, dict]:
    """What plait-plan prints and what --plan.json holds: a layout search, a max-batch search or a plan."""
    def progress(line):
        print(line, file=sys.stderr, flush=True)

    if plan_args.search:
        from .search import format_search, search, search_json

        result = search(config, plan_args, progress=progress)
        return format_search(result, config, plan_args), search_json(result)
    if plan_args.max_batch:
        from .max_batch import format_max_batch, max_batch, max_batch_json

        result = max_batch(config, plan_args, progress=progress)
        return format_max_batch(result, config, plan_args), max_batch_json(result, config, plan_args)
    from .report import format_report

    report = make_plan(config, plan_args)
    return format_report(report), report


if __name__ == "__main__":
    sys.exit(main())
