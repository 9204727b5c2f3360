"""plait.models: Llama 3 and DeepSeek-V3-style MoE as plain single-device PyTorch, grouped_mm experts, the permute-indices kernel, HF safetensors import/export."""

__version__ = "0.1.0"
