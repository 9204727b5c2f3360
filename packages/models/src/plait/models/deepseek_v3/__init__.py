"""DeepSeek-V3-style MoE transformer as plain single-device PyTorch: args, flavors, model."""

from plait.models.deepseek_v3.args import ModelArgs
from plait.models.deepseek_v3.flavors import FLAVORS
from plait.models.deepseek_v3.model import Transformer

__all__ = ["FLAVORS", "ModelArgs", "Transformer"]
