"""Qwen3, dense and MoE, as plain single-device PyTorch: args, flavors, model."""

from plait.models.qwen3.args import ModelArgs
from plait.models.qwen3.flavors import FLAVORS
from plait.models.qwen3.model import Transformer

__all__ = ["FLAVORS", "ModelArgs", "Transformer"]
