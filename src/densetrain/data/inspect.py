"""``densetrain data inspect``: counts, token statistics and a decoded sample of a dataset."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from densetrain.data.shards import TokenStore, load_dataset_tokenizer, load_metadata
from densetrain.errors import UserError
from densetrain.values import is_int_at_least


def inspect_dataset(
    path: str | os.PathLike, *, split: str = "train", sample_tokens: int = 200, top_k: int = 10
) -> dict:
    """Summary of one split of a prepared dataset (plain JSON-able values)."""
    for name, value in (("sample_tokens", sample_tokens), ("top_k", top_k)):
        if not is_int_at_least(value, 0):
            raise UserError(f"{name} must be an integer >= 0 (0: none shown), got {value!r}")
    root = Path(path)
    meta = load_metadata(root)
    if split not in meta["splits"]:
        raise UserError(f"split {split!r} not in {root}; splits: {sorted(meta['splits'])}")
    store = TokenStore(root, split, meta)
    tokenizer = load_dataset_tokenizer(root, meta)
    lengths = np.diff(np.r_[store.doc_starts, store.num_tokens]) if store.num_documents else []
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    outside, first_outside = 0, (0, 0)
    for start in range(0, store.num_tokens, 1 << 22):  # bounded memory over large splits
        chunk = store.read(start, min(1 << 22, store.num_tokens - start))
        bad = chunk >= tokenizer.vocab_size  # damaged shard bytes: counted, named below
        if bad.any():
            index = int(np.argmax(bad))
            outside, first_outside = outside + int(bad.sum()), (
                first_outside if outside else (start + index, int(chunk[index])))
            chunk = chunk[~bad]
        counts += np.bincount(chunk, minlength=tokenizer.vocab_size)
    if outside:
        raise store.bad_id_error(*first_outside, count=outside)
    top = np.argsort(-counts)[:top_k]
    sample = store.read(0, min(sample_tokens, store.num_tokens)) if store.num_tokens else []
    return {
        "path": str(root),
        "split": split,
        "dtype": meta["dtype"],
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "fingerprint": tokenizer.fingerprint},
        "num_shards": len(meta["splits"][split]["shards"]),
        "num_documents": store.num_documents,
        "num_tokens": store.num_tokens,
        "doc_tokens_mean": float(np.mean(lengths)) if len(lengths) else 0.0,
        "doc_tokens_median": float(np.median(lengths)) if len(lengths) else 0.0,
        "doc_tokens_max": int(np.max(lengths)) if len(lengths) else 0,
        "vocab_used": int((counts > 0).sum()),
        "top_tokens": [
            {"id": int(i), "text": tokenizer.decode([int(i)]), "count": int(counts[i])} for i in top
        ],
        "counts": meta["counts"],
        "splits": {name: s["num_tokens"] for name, s in meta["splits"].items()},
        "sample": tokenizer.decode(sample),
    }


def format_report(report: dict) -> str:
    """Human-readable text of ``inspect_dataset``'s result."""
    lines = [
        f"dataset   {report['path']} [{report['split']}]",
        f"tokens    {report['num_tokens']:,} in {report['num_documents']:,} documents, "
        f"{report['num_shards']} shards, {report['dtype']}",
        f"splits    {report['splits']}",
        f"doc len   mean {report['doc_tokens_mean']:.1f}, median {report['doc_tokens_median']:.0f},"
        f" max {report['doc_tokens_max']}",
        f"vocab     {report['vocab_used']:,} of {report['tokenizer']['vocab_size']:,} ids used; "
        f"fingerprint {report['tokenizer']['fingerprint'][:16]}",
        f"read      {report['counts']['read']}",
        f"removed   {report['counts']['removed']}",
        "top       " + ", ".join(f"{t['text']!r}:{t['count']}" for t in report["top_tokens"]),
        "sample    ---",
        report["sample"],
        "---",
    ]
    return "\n".join(lines)
