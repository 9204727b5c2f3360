"""Block-wise FP8 weights, as DeepSeek-V3 is released, back to a floating-point dtype.

The release stores most linear weights as `float8_e4m3fn` `W [out, in]` next to a float32
`W_scale_inv [ceil(out / 128), ceil(in / 128)]`: one scale per 128 x 128 block (the last blocks
may be partial), and the real weight is `W * scale_inv` block by block. `config.json` says so in
`quantization_config` (`quant_method: fp8`, `weight_block_size: [128, 128]`). Training needs the
real weights, so importing dequantises them; norms, embeddings, the router and the head are
stored unquantised and pass through.
"""

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size_from_config(config: dict) -> tuple[int, int] | None:
    """(rows, cols) of a block from `quantization_config`, or None for an unquantised checkpoint."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    rows, cols = quant.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def dequantize_block_fp8(weight_OI: torch.Tensor, scale_inv_BC: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight_OI * scale_inv` with one scale per `block` (rows, cols), in `dtype`."""
    rows, cols = block
    n_out, n_in = weight_OI.shape
    expected = (-(-n_out // rows), -(-n_in // cols))
    if tuple(scale_inv_BC.shape) != expected:
        raise ValueError(f"scale_inv of shape {tuple(scale_inv_BC.shape)} does not tile a [{n_out}, {n_in}] weight in "
                         f"{rows} x {cols} blocks (expected {expected}); check quantization_config.weight_block_size")
    scale_OI = scale_inv_BC.float().repeat_interleave(rows, 0)[:n_out].repeat_interleave(cols, 1)[:, :n_in]
    return (weight_OI.float() * scale_OI).to(dtype)


def dequantize_state_dict(hf_state_dict: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every `X` with an `X_scale_inv` beside it dequantised to `dtype`; the scales dropped; other
    tensors unchanged. An FP8 tensor without a scale is an error (it cannot be trained as is)."""
    out = {}
    for name, tensor in hf_state_dict.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in hf_state_dict:
                raise KeyError(f"{name} has no weight {name.removesuffix(SCALE_SUFFIX)!r} to scale")
            continue
        scale = hf_state_dict.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = dequantize_block_fp8(tensor, scale, block, dtype)
        elif tensor.dtype in FP8_DTYPES:
            raise ValueError(f"{name} is {tensor.dtype} but has no {name + SCALE_SUFFIX}: cannot dequantise it")
        else:
            out[name] = tensor
    return out


def dequantize_if_fp8(hf_state_dict: dict[str, torch.Tensor], config: dict,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`dequantize_state_dict` when the checkpoint is block-FP8 (by its config or its scales)."""
    block = block_size_from_config(config)
    if block is None and not any(name.endswith(SCALE_SUFFIX) for name in hf_state_dict):
        return hf_state_dict
    return dequantize_state_dict(hf_state_dict, block or (128, 128), dtype)
