"""Checks on a tensor read from a Hugging Face folder before it becomes a model weight.

Copying into a float parameter casts anything silently: an int32 tensor becomes float, an FP8
weight whose `_scale_inv` is missing becomes its raw codes (values up to 448), and a NaN trains
until the loss is NaN and is then blamed on the learning rate. So each tensor is checked where it
is read, and the error names the tensor and its file.
"""

import torch

from plait.models.hf.fp8 import FP8_DTYPES, SCALE_SUFFIX

# What a weight may be stored as; the copy into the model's dtype is then a plain rounding.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ImportCheckError(ValueError):
    """A tensor of a Hugging Face folder that cannot become a weight as is (one line)."""


def check_dtype(name: str, tensor: torch.Tensor, file: object, *, has_scale: bool) -> None:
    """FP8 only with its `_scale_inv` (`has_scale`); otherwise a floating-point dtype."""
    if tensor.dtype in FP8_DTYPES:
        if not has_scale:
            raise ImportCheckError(f"{name} in {file} is {tensor.dtype} but has no {name}{SCALE_SUFFIX}: its raw FP8 "
                                   f"codes are not the weight (re-export it with its scale, or dequantised)")
        return
    if tensor.dtype not in WEIGHT_DTYPES:
        raise ImportCheckError(f"{name} in {file} is {tensor.dtype}, not a floating-point weight "
                               f"({', '.join(str(d).removeprefix('torch.') for d in WEIGHT_DTYPES)} or FP8 with a scale)")


def check_finite(name: str, tensor: torch.Tensor, file: object) -> None:
    """No NaN / Inf (one pass over the tensor; FP8 is widened first, its NaN code included)."""
    values = tensor.float() if tensor.dtype in FP8_DTYPES else tensor
    bad = (~torch.isfinite(values)).sum().item()
    if bad:
        raise ImportCheckError(f"{name} in {file} holds {bad} NaN/Inf values of {values.numel()}: "
                               f"the weights are damaged, not the training (re-download or re-export them)")


def check_hf_state(hf_state_dict: dict[str, torch.Tensor], file: object) -> None:
    """`check_dtype` and `check_finite` for every tensor of a (whole or partial) HF state dict."""
    for name, tensor in hf_state_dict.items():
        check_dtype(name, tensor, file, has_scale=name + SCALE_SUFFIX in hf_state_dict)
        check_finite(name, tensor, file)
