"""FSDP over the tensor-parallel embedding (its own FSDP unit): FSDP's post-forward hook runs first.

Tensor parallel's output hook ends with `DTensor.to_local()`, which returns a view, and FSDP's
post-forward hook (registered later, so it ran after it) hooks its pre-backward on whatever the
module returns: torch warned on every rank, every run, "FSDP2-wrapped module (FSDPEmbedding)
returned a view tensor ... wrong gradients" (an in-place op on that view would drop the hook).
Nothing here modifies it in place, so the gradients were right, but the warning hid real ones.
Running FSDP's hook before TP's puts the pre-backward hook on the module's own DTensor output,
before the redistribute and `to_local`; the gradient reaches it through both, as before. Nothing
else changes: FSDP's post-forward only reshards the weights, which the redistribute does not read.
"""

from torch import nn


def fsdp_post_forward_first(model: nn.Module) -> list[str]:
    """Re-register FSDP's post-forward hook at the front on every embedding that is its own FSDP
    unit and has other forward hooks (tensor parallel's); return the module paths changed. Only
    embeddings: other units with hooks of their own (expert parallel's experts) keep their order."""
    from torch.distributed.fsdp import FSDPModule

    moved = []
    for path, module in model.named_modules():
        if not (isinstance(module, FSDPModule) and isinstance(module, nn.Embedding)):
            continue
        state = module._get_fsdp_state()
        handle = getattr(state, "_post_forward_hook_handle", None)
        if handle is None or len(state._modules) != 1 or len(module._forward_hooks) < 2:
            continue
        handle.remove()
        # As torch's own FSDP memory tracker re-registers it (torch.distributed._tools).
        state._post_forward_hook_handle = module.register_forward_hook(state._post_forward, prepend=True)
        moved.append(path)
    return moved
