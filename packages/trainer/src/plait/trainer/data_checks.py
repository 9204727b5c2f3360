"""The [data] checks of validation: sources readable, the tokenizer built and fitting the model,
a pre-tokenised folder written with this tokenizer and within the RoPE tables."""

from .config import Config, ConfigError

# Batches prepared ahead are held in host memory: more than this only costs memory.
MAX_PREFETCH = 16


def check_data(config: Config, read_sources: bool = True) -> None:
    from plait.data.sources import check_readable, resolve_source

    d = config.data
    if not 0 <= d.prefetch <= MAX_PREFETCH:
        raise ConfigError(f"data.prefetch = {d.prefetch}: must be in [0, {MAX_PREFETCH}] (batches prepared ahead, "
                          "each held in memory; 0 prepares batches in the step).")
    if not read_sources:
        return
    sources = [(d.dataset, d.dataset_path or None, "train")]
    if d.val_interval:
        sources.append((d.val_dataset, (d.dataset_path or None) if d.val_dataset == d.dataset else None, "validation"))
    for dataset, path, split in sources:
        try:
            resolve_source(dataset, path, split)
            check_readable(dataset, path, split, d.text_field)
        except (FileNotFoundError, ValueError) as e:
            key = "data.dataset" if split == "train" else "data.val_dataset"
            raise ConfigError(f"{key} = {dataset!r}: {e}") from None


def _check_token_folder(config: Config, tokenizer):
    """A pre-tokenised folder was written with this run's tokenizer (its meta.json says); its
    documents (None for other sources)."""
    from plait.data.sources import TOKENS

    if config.data.dataset != TOKENS:
        return None
    from plait.data.token_files import TokenFileDocuments

    try:
        documents = TokenFileDocuments(config.data.dataset_path, tokenizer, config.job.seed, shuffle=False)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.dataset = 'tokens': {e}") from None
    return documents


def _check_document_positions(config: Config, model_args, token_documents) -> None:
    """Per-document RoPE positions index the RoPE tables by a token's offset in its document: a
    document longer than max_seq_len has no table row. A pre-tokenised folder knows every length, so
    it is refused here; other sources are checked batch by batch (the trainer's _read_documents)."""
    if getattr(model_args, "rope_positions", "sequence") != "document" or token_documents is None:
        return
    offsets = token_documents.offsets
    longest = int((offsets[1:] - offsets[:-1]).max()) if len(offsets) > 1 else 0
    if longest > model_args.max_seq_len:
        raise ConfigError(
            f"model.rope_positions = 'document': {config.data.dataset_path} holds a document of {longest} tokens, "
            f"past model.max_seq_len = {model_args.max_seq_len} (the RoPE tables): raise model.max_seq_len to "
            f"{longest} or set model.rope_positions = 'sequence'."
        )


def build_checked_tokenizer(config: Config, model_args):
    """The run's tokenizer, checked against the model's vocabulary and the token folder's documents."""
    from plait.data import build_tokenizer

    try:
        tokenizer = build_tokenizer(config.model.tokenizer_path or None)
    except FileNotFoundError:
        raise ConfigError(f"model.tokenizer_path: tokenizer file not found: {config.model.tokenizer_path}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"model.tokenizer_path = {config.model.tokenizer_path!r}: {e}") from None
    _check_document_positions(config, model_args, _check_token_folder(config, tokenizer))
    if tokenizer.n_words > model_args.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.n_words} tokens but {config.model.name} {config.model.flavor} has "
            f"vocab_size = {model_args.vocab_size}: use a tokenizer that fits the model (model.tokenizer_path)."
        )
    return tokenizer
