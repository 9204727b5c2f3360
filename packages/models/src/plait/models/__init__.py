"""plait.models: Llama 3, Qwen3 (dense and MoE) and DeepSeek-V3-style MoE as plain single-device PyTorch, grouped_mm experts, the permute-indices kernel, HF safetensors import/export."""

from plait.models.registry import ModelSpec, build_model, get_model_args, get_model_spec, list_models, model_args_dict

__version__ = "0.1.1"

__all__ = ["ModelSpec", "build_model", "get_model_args", "get_model_spec", "list_models", "model_args_dict"]
