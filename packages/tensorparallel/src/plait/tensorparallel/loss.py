"""Loss parallel: cross-entropy on vocab-sharded logits without gathering them."""

import contextlib

from torch.distributed.tensor.parallel import loss_parallel


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """`loss_parallel()` when enabled, else a no-op context.

    With loss parallel the model returns DTensor logits sharded on the vocab dim; run the
    cross-entropy *and* its backward inside this context (the backward of the sharded softmax
    needs it too):

        with loss_parallel_context(enabled):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
