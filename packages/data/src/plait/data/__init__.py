"""Data for plait-train: the Llama 3 tokenizer and packed, resumable, dp-sharded batches.

    tok = build_tokenizer(None)                    # the shipped 2048-id BPE
    loader = build_dataloader("builtin", None, tok, seq_len=512, local_batch_size=8,
                              gradient_accumulation_steps=1, dp_rank=0, dp_degree=1, seed=0)
    for micro_batches in loader: ...   # [(inputs_BS, labels_BS, document_positions_BS)] * grad_accum

See packages/data/README.md.
"""

from .loader import PackedDataLoader, build_dataloader
from .sources import load_documents
from .tokenizer import Tokenizer, build_tokenizer

__version__ = "0.1.0"

__all__ = ["__version__", "PackedDataLoader", "Tokenizer", "build_dataloader", "build_tokenizer", "load_documents"]
