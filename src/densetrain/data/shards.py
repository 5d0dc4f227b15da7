"""Prepared-dataset files: token shards, document index, metadata; memory-mapped reading.

Layout of a prepared dataset directory::

    meta.json                  written last: its presence marks a complete dataset
    tokenizer.json | .model    a copy of the tokenizer used
    progress.json              resume state of ``prepare`` (kept for reference)
    train/00000.bin            token ids, native-endian uint16 (vocab <= 65536) or uint32
    train/00000.docs.npy       int64 token count of each document in the shard (EOS included)
    val/...                    the same for the validation split
    dedup/00000.npz            dedup state added by each commit (resume only)

Every file is written to a temporary name and renamed, so no reader sees a half-written shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FORMAT = "densetrain-tokens-v1"
META_FILE = "meta.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, value: object) -> None:
    """Write ``value`` as indented JSON through a temporary file and a rename."""
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def write_shard(
    root: Path, split: str, index: int, tokens: np.ndarray, doc_lengths: np.ndarray
) -> dict:
    """Write one shard (tokens + document lengths) atomically; return its metadata entry."""
    assert tokens.ndim == 1 and int(doc_lengths.sum()) == len(tokens)
    split_dir = root / split
    split_dir.mkdir(parents=True, exist_ok=True)
    bin_name, docs_name = f"{split}/{index:05d}.bin", f"{split}/{index:05d}.docs.npy"
    tmp_docs = root / (docs_name + ".tmp")
    with open(tmp_docs, "wb") as f:
        np.save(f, doc_lengths.astype(np.int64))
    os.replace(tmp_docs, root / docs_name)
    atomic_write_bytes(root / bin_name, tokens.tobytes())
    return {
        "file": bin_name,
        "docs": docs_name,
        "num_tokens": int(len(tokens)),
        "num_documents": int(len(doc_lengths)),
        "max_token_id": int(tokens.max()) if len(tokens) else -1,
    }


def load_metadata(root: str | os.PathLike) -> dict:
    """The ``meta.json`` of a complete prepared dataset; clear errors when missing/incomplete."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"prepared dataset directory {root} does not exist")
    meta_path = root / META_FILE
    if not meta_path.is_file():
        interrupted = (root / "progress.json").exists()
        hint = " (an interrupted prepare: rerun it to finish)" if interrupted else ""
        raise FileNotFoundError(f"{root} is not a complete prepared dataset: no {META_FILE}{hint}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


class TokenStore:
    """One split of a prepared dataset as a single memory-mapped token stream.

    ``read(start, length)`` returns tokens ``[start, start + length)`` of the concatenation of
    all shards; ``doc_starts`` holds each document's start offset in that stream.
    """

    def __init__(self, root: str | os.PathLike, split: str, meta: dict | None = None) -> None:
        self.root = Path(root)
        self.meta = meta if meta is not None else load_metadata(root)
        self.split = split
        self.dtype = np.dtype(self.meta["dtype"])
        shards = self.meta["splits"].get(split, {}).get("shards", [])
        limit = np.iinfo(self.dtype).max
        self._arrays: list[np.ndarray] = []
        doc_lengths: list[np.ndarray] = []
        for entry in shards:
            if entry["max_token_id"] > limit:
                raise ValueError(
                    f"{self.root / entry['file']}: token id {entry['max_token_id']} exceeds "
                    f"{self.dtype} (max {limit})"
                )
            path = self.root / entry["file"]
            expected = entry["num_tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise ValueError(f"shard {path} is missing or not {expected} bytes")
            self._arrays.append(np.memmap(path, dtype=self.dtype, mode="r"))
            doc_lengths.append(np.load(self.root / entry["docs"]))
        sizes = np.array([len(a) for a in self._arrays], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self._shard_starts[-1])
        lengths = np.concatenate(doc_lengths) if doc_lengths else np.zeros(0, dtype=np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.num_documents = int(len(lengths))

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64 (may span shards)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self._shard_starts[shard])
            take = min(length - filled, len(self._arrays[shard]) - offset)
            out[filled : filled + take] = self._arrays[shard][offset : offset + take]
            filled += take
            shard += 1
        return out

    def document_ids(self, start: int, length: int) -> np.ndarray:
        """Global document index of each token in ``[start, start + length)``."""
        offsets = np.arange(start, start + length, dtype=np.int64)
        return np.searchsorted(self.doc_starts, offsets, side="right") - 1
