"""`--model.*`: the model and flavor from the registry, the [model] overrides typed and checked.

The valid range of every model argument a run may override (`--model.<field>`), checked before
the arguments are built: a dim of 0 is otherwise a ZeroDivisionError, n_layers 0 trains an
empty model, and rope_theta <= 0 or norm_eps < 0 is a NaN at step 1 blamed on the learning rate.

Fields are looked up by name, so one table serves every model (a field a model lacks is skipped).
"""

import dataclasses
import difflib
import math
import types
import typing

from .config import Config, ConfigError, coerce

# field -> (smallest valid value, whether the bound itself is allowed); None values are skipped.
_AT_LEAST = {
    # sizes
    "dim": (1, True), "n_layers": (1, True), "n_heads": (1, True), "n_kv_heads": (1, True), "head_dim": (2, True),
    "vocab_size": (1, True), "multiple_of": (1, True), "max_seq_len": (1, True),
    "inter_dim": (1, True), "moe_inter_dim": (1, True),
    "n_routed_experts": (1, True),  # (qwen3: 0 is a dense model, its own table below)
    "n_shared_experts": (0, True), "n_dense_layers": (0, True),
    "n_expert_groups": (1, True), "n_limited_groups": (1, True),
    "q_lora_rank": (0, True),  # 0: no low-rank query path
    "kv_lora_rank": (1, True), "qk_nope_head_dim": (0, True), "qk_rope_head_dim": (2, True),
    "v_head_dim": (1, True), "original_seq_len": (1, True),
    "mtp_layers": (0, True),  # 0: no multi-token prediction
    # numerics
    "norm_eps": (0, False), "rope_theta": (0, False), "ffn_dim_multiplier": (0, False),
    "route_scale": (0, False), "aux_loss_coeff": (0, True), "load_balance_coeff": (0, True),
    "rope_factor": (0, False), "mscale": (0, True), "beta_fast": (0, False), "beta_slow": (0, False),
    "mtp_loss_scale": (0, True),
}


# field -> the values it may take (plait.models.documents).
_CHOICES = {"attention_mask": ("causal", "document"), "rope_positions": ("sequence", "document")}


# Models whose own args take a lower bound than the shared table's: model name -> field -> bound.
_AT_LEAST_BY_MODEL = {"qwen3": {"n_routed_experts": (0, True)}}


def _range(low: float, inclusive: bool) -> str:
    return f">= {low}" if inclusive else f"> {low}"


def check_model_args(values: dict, where: str, model: str = "") -> None:
    """Raise a ConfigError naming the first field of `values` (field -> value, the flavor's with
    the overrides applied) out of its range, and the range; `where` names the model and flavor,
    `model` the model name (a few bounds are its own: _AT_LEAST_BY_MODEL)."""
    for field, (low, inclusive) in {**_AT_LEAST, **_AT_LEAST_BY_MODEL.get(model, {})}.items():
        value = values.get(field)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise ConfigError(f"model.{field} = {value} ({where}): must be {_range(low, inclusive)}.")
    for field, choices in _CHOICES.items():
        if field in values and values[field] not in choices:
            raise ConfigError(f"model.{field} = {values[field]!r} ({where}): use one of {', '.join(map(repr, choices))}.")
    if values.get("rope_positions") == "document" and values.get("attention_mask", "causal") != "document":
        # Positions restarting at each document while attention crosses documents puts two tokens at
        # the same RoPE position in one attention window: no kernel computes anything meaningful.
        raise ConfigError(f"model.rope_positions = 'document' ({where}) needs model.attention_mask = 'document' "
                          "(positions restart per document only when attention stops there): set both.")
    pairs = [  # (field, lowest, the field that is its highest)
        ("n_activated_experts", 1, "n_routed_experts"),
        ("n_limited_groups", 1, "n_expert_groups"),
        ("n_dense_layers", 0, "n_layers"),
    ]
    if values.get("n_routed_experts") == 0:  # a dense Qwen3: no router, its top-k is unused
        pairs = pairs[1:]
    for field, low, upper in pairs:
        if field in values and upper in values and not low <= values[field] <= values[upper]:
            raise ConfigError(f"model.{field} = {values[field]} ({where}): must be in [{low}, {upper} = "
                              f"{values[upper]}].")
    _check_head_sizes(values, where)
    for field, by in [("n_heads", "n_kv_heads"), ("n_routed_experts", "n_expert_groups")]:
        if values.get(field) and values.get(by) and values[field] % values[by]:
            raise ConfigError(f"model.{field} = {values[field]} ({where}) is not divisible by model.{by} = "
                              f"{values[by]}: choose values where it is.")


def _check_head_sizes(values: dict, where: str) -> None:
    """The head size: model.head_dim where a model sets it on its own (Qwen3), else dim / n_heads."""
    if "head_dim" in values:
        if values["head_dim"] % 2:
            raise ConfigError(f"model.head_dim = {values['head_dim']} ({where}): must be even for RoPE.")
        return
    if values.get("dim") and values.get("n_heads") and values["dim"] % values["n_heads"]:
        raise ConfigError(f"model.dim = {values['dim']} ({where}) is not divisible by model.n_heads = "
                          f"{values['n_heads']}: choose values where it is.")
    if values.get("dim") and values.get("n_heads") and "n_kv_heads" in values and (values["dim"] // values["n_heads"]) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {values['dim'] // values['n_heads']} ({where}): the head "
                          "dim must be even for RoPE.")


def model_spec(config: Config):
    from plait.models import get_model_spec, list_models

    try:
        spec = get_model_spec(config.model.name)
    except KeyError:
        raise ConfigError(f"model.name = {config.model.name!r}: known models are {', '.join(list_models())}.") from None
    except ImportError as e:
        raise ConfigError(f"model.name = {config.model.name!r} cannot be imported ({e}).") from None
    if config.model.flavor not in spec.flavors:
        close = difflib.get_close_matches(config.model.flavor, list(spec.flavors), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise ConfigError(
            f"model.flavor = {config.model.flavor!r} is not a {config.model.name} flavor "
            f"({', '.join(spec.flavors)}).{hint}"
        )
    return spec


def resolve_model_args(config: Config, spec=None):
    """The flavor's ModelArgs with the [model] overrides applied, each checked and typed."""
    spec = spec or model_spec(config)
    base = spec.flavors[config.model.flavor]
    if not config.model.args:
        return base
    hints = typing.get_type_hints(type(base))
    names = [f.name for f in dataclasses.fields(base)]
    values = {}
    for name, value in config.model.args.items():
        if name not in names:
            close = difflib.get_close_matches(name, names + ["name", "flavor", "tokenizer_path", "init"], n=1)
            hint = f" Did you mean model.{close[0]}?" if close else ""
            raise ConfigError(
                f"unknown config key 'model.{name}': not a [model] key nor an argument of {config.model.name} "
                f"{config.model.flavor}.{hint}"
            )
        values[name] = _coerce_model_arg(f"model.{name}", hints[name], value)
    # Ranges first: a dim or n_heads of 0 would otherwise be a ZeroDivisionError in the args.
    check_model_args({**{f: getattr(base, f) for f in names}, **values}, f"{config.model.name} {config.model.flavor}",
                     config.model.name)
    try:
        return dataclasses.replace(base, **values)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model arguments {values}: {e}.") from None


def _coerce_model_arg(key: str, tp, value):
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: set it as a table in the TOML file, e.g. {key.split('.')[1]} = {{...}}.")
        return tp(**value)
    return coerce(key, tp, value)
