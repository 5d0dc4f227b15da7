"""Shared fixtures: a small synthetic corpus, a tokenizer trained on it, a prepared dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import synthetic_documents, write_text_files

from densetrain.data import PrepareConfig, prepare_dataset, train_tokenizer


@pytest.fixture(scope="session")
def corpus_docs() -> list[str]:
    """200 synthetic documents."""
    return synthetic_documents(200)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, corpus_docs) -> Path:
    """A 512-token byte-level BPE trained on the synthetic corpus."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(corpus_docs, path, vocab_size=512)
    return path


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, corpus_docs, tokenizer_path) -> Path:
    """The synthetic corpus prepared with a 10% validation split and small shards."""
    root = tmp_path_factory.mktemp("prepared")
    write_text_files(root / "raw", corpus_docs)
    out = root / "ds"
    cfg = PrepareConfig(val_fraction=0.1, shard_tokens=4000, batch_bytes=4000)
    prepare_dataset([str(root / "raw")], out, tokenizer=tokenizer_path, cfg=cfg)
    return out
