"""Synthetic corpora for the data-layer tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "data model train token batch shard layer value python function return class import def"
).split()


def synthetic_documents(count: int, *, seed: int = 0, min_words: int = 20, max_words: int = 200):
    """Random documents of common words with punctuation, digits and some non-ASCII text."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(min_words, max_words)))
        lines = [" ".join(words[j : j + 12]) for j in range(0, len(words), 12)]
        docs.append(f"Document {i}: " + ".\n".join(lines) + " — naïve café 数据 ✓\n")
    return docs


def write_text_files(directory: Path, docs: list[str]) -> list[Path]:
    """One .txt file per document, names sorting in document order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, doc in enumerate(docs):
        path = directory / f"doc{i:05d}.txt"
        path.write_text(doc, encoding="utf-8")
        paths.append(path)
    return paths
