"""The interface every Hugging Face state-dict adapter follows.

An adapter is a module (e.g. `plait.models.hf.llama3`, `plait.models.hf.deepseek_v3`, `plait.models.hf.qwen3`) defining:

    to_hf(state_dict: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]
        plait names and layouts -> HF names and layouts. Every key of the plait state dict is
        consumed; a key it does not know raises KeyError. Tied weights appear once, as HF saves them.

    from_hf(hf_state_dict: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]
        The inverse. The result loads with `model.load_state_dict(sd, strict=True)` into
        `model_cls(args)`; buffers HF may carry (e.g. rotary inv_freq) are dropped.

    hf_config(args: ModelArgs) -> dict
        The `config.json` content (architectures, model_type, sizes) that lets
        `transformers.AutoModelForCausalLM.from_pretrained` rebuild the same model.

    args_from_hf_config(config: dict) -> ModelArgs
        The inverse: plait args from a parsed `config.json`. Raises ValueError for a config the
        plait model cannot represent (biases, another activation, ...).

It names the HF class it writes as `HF_ARCHITECTURE` (plait.checkpoint matches a folder's
`architectures` against it), or every class it reads as `HF_ARCHITECTURES` when one plait model is
several HF ones (`plait.models.hf.qwen3`: Qwen3ForCausalLM and Qwen3MoeForCausalLM).

Both conversions also take a subset of the state dict holding whole layers (the trainer converts
a layer at a time), so a tensor HF stores twice (DeepSeek-V3's multi-token-prediction layers
repeat the embedding and the head) is written by the call that converts the original.

Conversions are pure functions on CPU tensors (no I/O, no dtype change): `plait.models.hf.io`
reads and writes the files, and `plait.models.hf.convert` composes the two.
"""

from typing import Any, Protocol

import torch


class HFAdapter(Protocol):
    """Structural type of an adapter module (for type checkers; modules satisfy it as is)."""

    def to_hf(self, state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]: ...

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]: ...

    def hf_config(self, args: Any) -> dict: ...

    def args_from_hf_config(self, config: dict) -> Any: ...
