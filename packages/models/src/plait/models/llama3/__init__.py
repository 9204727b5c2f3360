"""Llama 3 as plain single-device PyTorch: args, flavors, model."""

from plait.models.llama3.args import ModelArgs, RopeScaling
from plait.models.llama3.flavors import FLAVORS
from plait.models.llama3.model import Transformer

__all__ = ["FLAVORS", "ModelArgs", "RopeScaling", "Transformer"]
