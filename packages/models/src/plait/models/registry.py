"""Model name -> (flavors, model class, HF adapter), so a trainer can build any plait model by name.

Entries are import strings, resolved only when that model is asked for: one model's module
missing or failing to import never breaks another.
"""

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # flavor name -> the model's args dataclass instance (e.g. llama3.ModelArgs)
    flavors: dict[str, Any]
    # built as model_cls(args); has init_weights, parallel_info, flops_per_token
    model_cls: type[nn.Module]
    # module with to_hf / from_hf / hf_config / args_from_hf_config (see plait.models.hf.adapter)
    hf_adapter: ModuleType


_REGISTRY: dict[str, dict[str, str]] = {
    "llama3": {
        "flavors": "plait.models.llama3.flavors:FLAVORS",
        "model_cls": "plait.models.llama3.model:Transformer",
        "hf_adapter": "plait.models.hf.llama3",
    },
    # ---- DeepSeek-V3: owned by the MoE half of plait-models; adjust these paths there. ----
    "deepseek_v3": {
        "flavors": "plait.models.deepseek_v3.flavors:FLAVORS",
        "model_cls": "plait.models.deepseek_v3.model:Transformer",
        "hf_adapter": "plait.models.hf.deepseek_v3",
    },
    # ---- end DeepSeek-V3 ----
    # Qwen3 dense and Qwen3-MoE: one model, the flavor (n_routed_experts) picks the block kind.
    "qwen3": {
        "flavors": "plait.models.qwen3.flavors:FLAVORS",
        "model_cls": "plait.models.qwen3.model:Transformer",
        "hf_adapter": "plait.models.hf.qwen3",
    },
}


def _resolve(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def list_models() -> list[str]:
    return list(_REGISTRY)


@functools.cache
def get_model_spec(name: str) -> ModelSpec:
    """The spec registered under `name`, importing its modules now."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {list_models()}")
    entry = _REGISTRY[name]
    return ModelSpec(name=name, **{field: _resolve(target) for field, target in entry.items()})


def get_model_args(name: str, flavor: str, **overrides: Any) -> Any:
    """A copy of flavor `flavor`'s args with `overrides` applied (e.g. max_seq_len, vocab_size)."""
    flavors = get_model_spec(name).flavors
    if flavor not in flavors:
        raise KeyError(f"model {name!r} has no flavor {flavor!r}; known: {list(flavors)}")
    return dataclasses.replace(flavors[flavor], **overrides)


def build_model(name: str, flavor: str, **overrides: Any) -> nn.Module:
    """model_cls(args) on the current default device; wrap in `torch.device("meta")` for big models."""
    return get_model_spec(name).model_cls(get_model_args(name, flavor, **overrides))


def model_args_dict(model_args) -> dict:
    """A model's arguments as plain TOML / JSON values (nested dataclasses as dicts): what
    `plait-train --print-config` prints and a checkpoint's marker records."""
    return {f.name: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for f in dataclasses.fields(model_args) for v in [getattr(model_args, f.name)]}
