"""The run's configuration: one dataclass per section, loaded from TOML plus `--section.key value`.

Every field is documented by the string literal under it; `plait-train --help` prints those
docs, and `--print-config` prints the effective configuration as TOML. Unknown keys fail with
the closest valid name.
"""

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import types
import typing
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal

# A configuration that cannot run: one class for every package that raises it (plait-checkpoint's
# errors are ConfigErrors too); `plait-train` prints the message (one line) and exits 2.
from plait.mesh.errors import ConfigError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from .sections import (  # noqa: F401  (the sections are imported from here too)
    SECTIONS,
    CheckpointConfig,
    CommConfig,
    Config,
    DataConfig,
    JobConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)

# ---- field docs ---------------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of dataclass `cls` (its attribute docstring)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs = {}
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ---- typed values -------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is tuple:
        return "(" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + ")"
    return getattr(tp, "__name__", str(tp))


def coerce(name: str, tp: Any, value: Any) -> Any:
    """`value` (a TOML value or a command-line string) as type `tp`, or ConfigError naming `name`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        value = coerce(name, type(choices[0]), value)
        if value not in choices:
            raise ConfigError(f"{name} = {value!r}: choose one of {', '.join(map(str, choices))}.")
        return value
    if origin is tuple:
        items = value
        if isinstance(value, str):
            items = [s for s in value.strip("[]() ").split(",") if s.strip()]
        if not isinstance(items, (list, tuple)) or len(items) != len(typing.get_args(tp)):
            raise ConfigError(f"{name} = {value!r}: expected {len(typing.get_args(tp))} values, e.g. 0.9,0.95.")
        return tuple(coerce(name, a, v) for a, v in zip(typing.get_args(tp), items))
    if origin is list:
        items = value
        if isinstance(value, str):
            items = [s for s in value.strip("[]() ").split(",") if s.strip()]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name} = {value!r}: expected a list, e.g. 1,3 (or [] for none).")
        return [coerce(name, typing.get_args(tp)[0], v) for v in items]
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"unsupported config type {tp} for {name}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{name} = {value!r}: expected true or false.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value), 0)
        except ValueError:
            raise ConfigError(f"{name} = {value!r}: expected an integer.") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} = {value!r}: expected a number.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} = {value!r}: expected a number.") from None
        if not math.isfinite(number):
            # float() accepts "nan" and "inf": a NaN lr crashes inside torch, an infinite one trains
            # to NaN, a NaN max_norm silently disables clipping.
            raise ConfigError(f"{name} = {value!r}: must be a finite number.")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{name} = {value!r}: expected a string.")
        return str(value)
    raise TypeError(f"unsupported config type {tp} for {name}")


def _closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" Did you mean {match[0]}?" if match else f" Valid: {', '.join(candidates)}."


def _plain_fields(cls: type) -> list:
    """The fields that are config keys (ModelConfig.args holds model arguments instead)."""
    return [f for f in fields(cls) if f.name != "args"]


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in _plain_fields(cls)]


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=False)
    return {f.name: hints[f.name] for f in fields(cls)}


def set_value(config: Config, key: str, value: Any) -> None:
    """Set `section.name` from a TOML value or a command-line string, with type checks."""
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise ConfigError(f"unknown config key {key!r}.{_closest(key, all_keys())}")
    cls = SECTIONS[section]
    types_ = _field_types(cls)
    if section == "model" and (name not in types_ or name == "args"):
        # A model argument: its name and type are checked against the flavor's ModelArgs in validation.
        config.model.args[name] = value
        return
    if name not in types_:
        raise ConfigError(f"unknown config key {key!r}.{_closest(key, all_keys())}")
    setattr(getattr(config, section), name, coerce(key, types_[name], value))


def _shipped_config(name: str) -> Path | None:
    path = resources.files("plait.trainer") / "configs" / name
    return Path(str(path)) if path.is_file() else None


def load_toml(path: str) -> dict:
    """Parse a TOML file; a bare name (`llama3_8B.toml`) also finds the shipped configs."""
    file = Path(path)
    if not file.is_file():
        shipped = _shipped_config(path) or _shipped_config(path + ".toml")
        if shipped is None:
            raise ConfigError(f"config file not found: {path} (shipped configs: {', '.join(shipped_configs())}).")
        file = shipped
    try:
        with open(file, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot parse {file}: {e}.") from None


def shipped_configs() -> list[str]:
    folder = resources.files("plait.trainer") / "configs"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".toml"))


def build_config(toml: dict | None = None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Defaults, then the TOML tables, then `--section.key value` overrides (in order)."""
    config = Config()
    for section, table in (toml or {}).items():
        if not isinstance(table, dict):
            raise ConfigError(f"top-level key {section!r} in the config file must be a [section].")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section [{section}].{_closest(section, list(SECTIONS))}")
        for name, value in table.items():
            set_value(config, f"{section}.{name}", value)
    for key, value in overrides:
        set_value(config, key, value)
    if config.fault_tolerance.enable:  # a replica group writes in a folder of its own (fault_tolerance.py)
        ft = config.fault_tolerance
        config.job.dump_folder = str(Path(config.job.dump_folder) / f"replica_{ft.replica_id}")
    return config


# ---- output -------------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(config: Config, with_docs: bool = False, model_args: dict | None = None) -> str:
    """The config as TOML. `model_args` (the flavor's effective arguments) are written as [model]
    keys; without it only the overrides in `config.model.args` are."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for f in _plain_fields(cls):
            if with_docs and f.name in docs:
                lines.append(f"# {docs[f.name]}")
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(config, section), f.name))}")
        if section == "model":
            args = model_args if model_args is not None else config.model.args
            if args and with_docs:
                lines.append(f"# Model arguments ({'the flavor with overrides' if model_args else 'overrides'}); "
                             "any of them can be set here or as --model.<field>.")
            for name, value in args.items():
                # TOML has no null: an argument left at None is shown commented out.
                lines.append(f"# {name} = none" if value is None else f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def help_text() -> str:
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]")
        docs = field_docs(cls)
        types_ = _field_types(cls)
        default = cls()
        for f in _plain_fields(cls):
            out.append(
                f"  --{section}.{f.name} {_type_name(types_[f.name]).upper() if types_[f.name] in (int, float, str, bool) else _type_name(types_[f.name])}"
                f"  (default: {_toml_value(getattr(default, f.name))})"
            )
            if f.name in docs:
                out.append(f"      {docs[f.name]}")
        if section == "model":
            out.append("  --model.<field> VALUE  (default: the flavor's)")
            out.append(f"      {docs['args']} --print-config lists them.")
        out.append("")
    return "\n".join(out)
