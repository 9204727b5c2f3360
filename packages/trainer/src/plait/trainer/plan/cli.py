"""`plait-plan`: what one rank of a layout holds, sends and computes per step, before the run.

    plait-plan --config deepseek_v3_671B.toml --plan.world_size 512
    plait-plan --config llama3_8B.toml --plan.world_size 64 --parallelism.tp 8 --plan.device h200
    plait-plan --config llama3_debugmodel.toml --plan.world_size 2 --parallelism.dp_shard 2 --plan.json plan.json

The config and every --section.key flag are plait-train's, validated by the same code (same
one-line errors, exit 2). The --plan.* flags are the planner's own:

  --plan.world_size N         ranks of the run (default: the product of the configured degrees)
  --plan.device h100|h200     device whose peak, memory and links the step is read against (h100)
  --plan.device_memory_gib G  memory per device (default: the device's)
  --plan.json PATH            also write the plan as JSON
  --plan.search               list the layouts that fit --plan.world_size, fewest bytes per token first,
                              each as plait-train flags (plan/search.py)
  --plan.search_limit N       layouts the search traces at most (default 12)
"""

import json
import os
import sys
from dataclasses import dataclass

from .. import exit_codes
from ..config import ConfigError

PLAN_KEYS = ("world_size", "device", "device_memory_gib", "json", "search", "search_limit")


@dataclass
class PlanArgs:
    world_size: int | None = None
    device: str = "h100"
    device_memory_gib: float | None = None
    json: str | None = None
    search: bool = False
    search_limit: int | None = None


def split_plan_args(argv: list[str]) -> tuple[PlanArgs, list[str]]:
    """The --plan.* flags, and the rest for plait-train's parser."""
    from .devices import DEVICES

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
        if key == "search" and not eq:
            value = argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in ("true", "false") else None
            plan.search, i = value != "false", i + (2 if value else 1)
            continue
        if value is None:
            raise ConfigError(f"{name} needs a value.")
        i += 1 if eq else 2
        try:
            if key == "world_size":
                plan.world_size = int(value)
                if plan.world_size < 1:
                    raise ValueError
            elif key == "search":
                if value not in ("true", "false"):
                    raise ValueError
                plan.search = value == "true"
            elif key == "search_limit":
                plan.search_limit = int(value)
                if plan.search_limit < 1:
                    raise ValueError
            elif key == "device_memory_gib":
                plan.device_memory_gib = float(value)
                if plan.device_memory_gib <= 0:
                    raise ValueError
            elif key == "device":
                if value.lower() not in DEVICES:
                    raise ValueError
                plan.device = value.lower()
            else:
                plan.json = value
        except ValueError:
            expected = {"world_size": "a number of ranks >= 1", "device_memory_gib": "GiB > 0",
                        "search": "true or false", "search_limit": "a number of layouts >= 1",
                        "device": " or ".join(DEVICES)}[key]
            raise ConfigError(f"{name} = {value!r}: expected {expected}.") from None
    return plan, rest


def default_world_size(config) -> int:
    """The product of the configured degrees (dp_shard = -1 counts as 1)."""
    p = config.parallelism
    return max(1, p.dp_replicate) * max(1, p.dp_shard) * p.cp * p.tp * max(1, p.pp)


def make_plan(config, plan_args: PlanArgs) -> dict:
    """Validate (as plait-train), trace rank 0's step, and report against the device."""
    import dataclasses

    from ..memory_estimate import estimate_memory
    from ..validate import validate
    from .devices import DEVICES
    from .report import build_report
    from .trace import trace_step

    world_size = plan_args.world_size or default_world_size(config)
    plan = validate(config, world_size=world_size)
    # Compiled blocks run the same ops; the trace runs them eagerly (no compiler under fake tensors).
    traced_config = dataclasses.replace(config, training=dataclasses.replace(config.training, compile=False))
    traced = trace_step(traced_config, plan)
    device = DEVICES[plan_args.device]
    memory_gib = plan_args.device_memory_gib or device.memory_gib
    analytic = estimate_memory(config, plan.dims, plan.model, plan.info).parts()
    return build_report(config, plan, traced, device, memory_gib, analytic)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import warnings

    # DTensor's random ops on a CPU mesh: the fake step draws no numbers that matter.
    warnings.filterwarnings("ignore", message="DTensor random operators")
    import logging

    # "2 sequential all_reduce operations" for a 2-D gradient norm: counted in the plan already.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from ..cli import DEFAULT_CONFIG, parse_args
    from ..config import build_config, load_toml

    try:
        if any(a in ("-h", "--help") for a in argv):
            print(__doc__)
            return exit_codes.FINISHED
        plan_args, rest = split_plan_args(argv)
        args = parse_args(rest)
        config = build_config(load_toml(args.config or DEFAULT_CONFIG), args.overrides)
        if plan_args.search:
            from .search import format_search, search, search_json

            result = search(config, plan_args, progress=lambda line: print(line, file=sys.stderr, flush=True))
        else:
            report = make_plan(config, plan_args)
    except ConfigError as e:
        print(f"plait-plan: error: {e}", file=sys.stderr)
        return exit_codes.CONFIG
    if plan_args.search:
        print(format_search(result, config, plan_args))
        if plan_args.json:
            with open(plan_args.json, "w") as f:
                json.dump(search_json(result), f, indent=1)
        return exit_codes.FINISHED
    from .report import format_report

    print(format_report(report))
    if plan_args.json:
        with open(plan_args.json, "w") as f:
            json.dump(report, f, indent=1)
    return exit_codes.FINISHED


if __name__ == "__main__":
    sys.exit(main())
