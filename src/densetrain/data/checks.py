"""Checks of a job's data against its model, cheap enough to run before any work starts.

`data_vocabulary` finds the vocabulary a job's tokens come from without preparing anything;
`check_tokenizer_fits_model` refuses a model whose embedding is smaller than that vocabulary
(otherwise the first batch fails deep inside the embedding lookup with an ``IndexError``).
"""

from __future__ import annotations

from dataclasses import dataclass

from densetrain.data.config import DataConfig
from densetrain.data.remote import resolve_dataset
from densetrain.data.shards import load_dataset_tokenizer, load_metadata
from densetrain.errors import UserError, UserFileNotFoundError


@dataclass(kw_only=True)
class DataVocabulary:
    """How many token ids a job's data may hold, and where that number comes from."""

    vocab_size: int
    max_token_id: int  # the largest id stored in the datasets' shards; -1 when unknown
    source: str


def data_vocabulary(cfg: DataConfig) -> DataVocabulary:
    """The vocabulary of ``cfg``'s data: ``data.tokenizer``, else the datasets', else the default
    corpus's ``data.default_vocab_size``. Opens each dataset (its cheap integrity check runs), so
    a missing, incomplete or damaged dataset is named here."""
    metas = []
    for path in cfg.datasets:
        source = resolve_dataset(path, cfg)  # a URL is opened: `data.remote`
        if source.remote is not None:
            metas.append((source.root, source.remote.meta))
            continue
        root = source.root
        if not root.is_dir():
            what = "is a file, not a directory" if root.exists() else "does not exist"
            raise UserFileNotFoundError(
                f"data.datasets: {path!r} {what}; give directories written by "
                "`densetrain data prepare`"
            )
        metas.append((root, load_metadata(root)))
    max_id = max(
        (e["max_token_id"] for _, m in metas for s in m["splits"].values() for e in s["shards"]),
        default=-1,
    )
    if cfg.tokenizer:
        from densetrain.data.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg.tokenizer)
        return DataVocabulary(vocab_size=tok.vocab_size, max_token_id=max_id,
                              source=f"data.tokenizer {cfg.tokenizer}")
    if metas:
        root, meta = max(metas, key=lambda rm: rm[1]["tokenizer"]["vocab_size"])
        load_dataset_tokenizer(root, meta)  # its meta.json's vocab_size is the tokenizer's
        return DataVocabulary(vocab_size=int(meta["tokenizer"]["vocab_size"]), max_token_id=max_id,
                              source=f"the tokenizer of dataset {root}")
    return DataVocabulary(vocab_size=cfg.default_vocab_size, max_token_id=-1,
                          source="data.default_vocab_size (the default corpus's tokenizer)")


def check_tokenizer_fits_model(vocab: DataVocabulary, model_vocab_size: int) -> None:
    """``UserError`` when a token id of the data could index past the model's embedding."""
    if vocab.vocab_size > model_vocab_size:
        raise UserError(
            f"model.vocab_size={model_vocab_size} is smaller than the vocabulary of "
            f"{vocab.source} ({vocab.vocab_size} ids): ids >= {model_vocab_size} have no "
            f"embedding row; set model.vocab_size >= {vocab.vocab_size} (or leave it unset with "
            "a preset that takes the tokenizer's) or use a matching tokenizer"
        )
    if vocab.max_token_id >= model_vocab_size:
        raise UserError(
            f"the datasets hold token id {vocab.max_token_id} but model.vocab_size is "
            f"{model_vocab_size}; set model.vocab_size > {vocab.max_token_id}"
        )
