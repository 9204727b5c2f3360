"""Packed, layout-independent, resumable batches.

One deterministic token stream per (dataset, split, seed): documents in a per-epoch shuffled
order (map-style datasets; streaming datasets in their own order), each tokenised as
`<|begin_of_text|> text <|end_of_text|>`, concatenated across documents and epochs, and cut into
windows of `seq_len + 1` tokens. Window i is sequence i of the stream; its first `seq_len`
tokens are the inputs and its last `seq_len` the labels. Next to them, each input token's offset
inside its document (`document_positions_BS`: 0 at its `<|begin_of_text|>`; a row that starts
mid-document continues that document's count), from which document masking cuts a row into
its documents and per-document RoPE takes its positions (packages/data/README.md).

Step k's global batch is sequences [k*G, (k+1)*G) with G = local_batch_size * grad_accum *
dp_degree. Dp rank r takes the contiguous rows [r*L*A, (r+1)*L*A) (L = local_batch_size,
A = grad_accum) and micro-batch m the rows [m*L, (m+1)*L) of that slice. So the global batch,
and the loss averaged over it, is the same whatever the dp degree and accumulation split.

The ranks of an `exchange` (see `exchange.py`) tokenise the stream's documents between them and
each receives only its own rows (`stream.py`); every rank knows the whole layout, so every rank
holds the same position. The position (epoch, document, token offset in it) is the loader's
state: restoring it, under any dp degree or batch layout, continues the same stream.
"""

from __future__ import annotations

from typing import Any

import torch

from .documents import MapDocuments, StreamDocuments
from .exchange import SoloExchange
from .sources import TOKENS, load_documents, resolve_source
from .stream import IndexedTokenStream, SharedTokenStream
from .token_files import TokenFileDocuments
from .tokenizer import Tokenizer

# (inputs_BS int64, labels_BS int64, document_positions_BS int32), all on the CPU.
MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PackedDataLoader:
    """Iterate to get, per optimizer step, this rank's `grad_accum` micro-batches
    `(inputs_BS, labels_BS, document_positions_BS)` (int64, int64, int32; CPU). Infinite;
    `state_dict()` is the stream position.

    `exchange` holds the ranks that share the tokenising (every rank of the job, whatever its
    dp rank); without one this rank tokenises everything up to its rows alone.
    """

    def __init__(self, documents, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                 gradient_accumulation_steps: int, dp_rank: int, dp_degree: int, seed: int,
                 description: str = "", exchange=None):
        for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size),
                            ("gradient_accumulation_steps", gradient_accumulation_steps),
                            ("dp_degree", dp_degree)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        self.tokenizer = tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.dp_rank, self.dp_degree, self.seed = dp_rank, dp_degree, seed
        self.description = description
        self.global_batch_size = local_batch_size * gradient_accumulation_steps * dp_degree
        self.sequence = 0  # index in the stream of the next global batch's first sequence
        self.documents = documents
        if hasattr(documents, "length"):  # pre-tokenised: lengths known, each rank reads its rows
            self._stream = IndexedTokenStream(documents)
        else:
            self._stream = SharedTokenStream(documents, exchange or SoloExchange())

    @property
    def encoded_documents(self) -> int:
        """Documents this rank has tokenised so far."""
        return self._stream.encoded_documents

    @property
    def encoded_tokens(self) -> int:
        return self._stream.encoded_tokens

    def __iter__(self) -> PackedDataLoader:
        return self

    def __next__(self) -> list[MicroBatch]:
        window = self.seq_len + 1
        rows = self.local_batch_size * self.gradient_accumulation_steps
        first = self.dp_rank * rows * window
        tokens, positions = self._stream.take(self.global_batch_size * window, first, first + rows * window)
        self.sequence += self.global_batch_size
        mine = torch.from_numpy(tokens.reshape(rows, window)).long()
        # The inputs' positions: a window's last token is only a label.
        where = torch.from_numpy(positions.reshape(rows, window)[:, :-1])
        micro_batches = []
        for m in range(self.gradient_accumulation_steps):
            rows_m = slice(m * self.local_batch_size, (m + 1) * self.local_batch_size)
            part = mine[rows_m]
            micro_batches.append((part[:, :-1].contiguous(), part[:, 1:].contiguous(), where[rows_m].contiguous()))
        return micro_batches

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream (the same on every dp rank); plain ints and dicts."""
        if self._stream.split:  # streaming split by node: every rank's stream position
            return {"sequence": self.sequence, "offset": self._stream.offset, "seed": self.seed,
                    "seq_len": self.seq_len, "split_by_node": self._stream.split_state()}
        epoch, doc, offset, hf_state = self._stream.position()
        state = {"sequence": self.sequence, "epoch": epoch, "doc": doc, "offset": offset,
                 "seed": self.seed, "seq_len": self.seq_len}
        if isinstance(self.documents, StreamDocuments):
            state["hf_state"] = hf_state
        else:
            state["num_documents"] = self.documents.num_documents
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream; works under another dp degree or batch layout."""
        if isinstance(self.documents, MapDocuments):
            n = self.documents.num_documents
            if state.get("num_documents", n) != n:
                raise ValueError(f"loader state is for a dataset of {state['num_documents']} documents, "
                                 f"{self.documents.name} has {n}: resume with the dataset the run started "
                                 "with, or start a new run (another job.dump_folder)")
            if state["seed"] != self.seed:
                raise ValueError(f"loader state was saved with job.seed {state['seed']}, this run has "
                                 f"{self.seed}: the document order would differ; resume with "
                                 f"--job.seed {state['seed']}")
        if self._stream.split or "split_by_node" in state:
            if not (self._stream.split and "split_by_node" in state):
                raise ValueError("the loader state and this run differ in splitting the stream by node "
                                 "(streaming on several ranks): resume on the same number of ranks")
            self.sequence = int(state["sequence"])
            split = state["split_by_node"]
            self._stream.seek_split(int(split["phase"]), split["ranks"], int(state["offset"]))
            return
        self.sequence = int(state["sequence"])
        self._stream.seek(int(state["epoch"]), int(state["doc"]), int(state["offset"]), state.get("hf_state"))

    def __repr__(self) -> str:
        return (f"PackedDataLoader({self.description}, seq_len={self.seq_len}, "
                f"global_batch={self.global_batch_size}, dp {self.dp_rank}/{self.dp_degree})")


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer: Tokenizer, seq_len: int,
                     local_batch_size: int, gradient_accumulation_steps: int, dp_rank: int,
                     dp_degree: int, seed: int, split: str = "train", streaming: bool = False,
                     text_field: str = "text", exchange=None) -> PackedDataLoader:
    """A packed loader over `dataset` (see `plait.data.sources` for the names).

    Map-style datasets are shuffled per epoch from `seed` for the train split and read in order
    for other splits; streaming datasets are read in order. `exchange`: see PackedDataLoader.
    """
    name = f"{dataset_path or dataset} ({split})"
    if dataset == TOKENS:
        resolve_source(dataset, dataset_path, split)
        documents = TokenFileDocuments(dataset_path, tokenizer, seed, shuffle=split == "train", split=split)
        return PackedDataLoader(documents, tokenizer, seq_len, local_batch_size, gradient_accumulation_steps,
                                dp_rank, dp_degree, seed, description=f"{dataset_path}:{split}")
    ds = load_documents(dataset, dataset_path, split=split, streaming=streaming)
    if streaming:
        # On several ranks each reads (downloads) only its part of the stream.
        split = (exchange.rank, exchange.size) if exchange is not None and exchange.size > 1 else None
        documents = StreamDocuments(ds, text_field, tokenizer, name=name, split=split)
    else:
        cache_key = (split, tokenizer.model_path, tokenizer.n_words) if dataset == "builtin" else None
        documents = MapDocuments(ds, text_field, tokenizer, seed, shuffle=split == "train",
                                 cache_key=cache_key, name=name)
    return PackedDataLoader(documents, tokenizer, seq_len, local_batch_size, gradient_accumulation_steps,
                            dp_rank, dp_degree, seed, description=f"{dataset}:{split}", exchange=exchange)
