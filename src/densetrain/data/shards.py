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

Integrity: each shard's entry in ``meta.json`` records the SHA-256 of its token file
(``sha256``), of its first 64 KiB (``head_sha256``) and of its document index (``docs_sha256``).
Opening a split (`TokenStore`) checks the cheap ones — every token file's size and first 64 KiB
and every document index — so a truncated, swapped or foreign shard (e.g. one tokenized by
another tokenizer of the same vocabulary size) is refused before training reads it;
`verify_dataset` (``densetrain data verify``) hashes every byte.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np

from densetrain.errors import DamagedFileError, UserError

FORMAT = "densetrain-tokens-v2"
FORMAT_WITHOUT_CHECKSUMS = "densetrain-tokens-v1"
META_FILE = "meta.json"
HEAD_BYTES = 1 << 16
_HASH_BLOCK = 1 << 22


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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:  # e.g. a full disk: leave nothing half-written, name the file
        tmp.unlink(missing_ok=True)
        raise OSError(error.errno, error.strerror, str(path)) from error


def atomic_write_json(path: Path, value: object) -> None:
    """Write ``value`` as indented JSON through a temporary file and a rename."""
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` in NumPy's ``.npy`` format (no pickled objects)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_shard(
    root: Path, split: str, index: int, tokens: np.ndarray, doc_lengths: np.ndarray
) -> dict:
    """Write one shard (tokens + document lengths) atomically; return its metadata entry."""
    assert tokens.ndim == 1 and int(doc_lengths.sum()) == len(tokens)
    split_dir = root / split
    split_dir.mkdir(parents=True, exist_ok=True)
    bin_name, docs_name = f"{split}/{index:05d}.bin", f"{split}/{index:05d}.docs.npy"
    docs = npy_bytes(doc_lengths.astype(np.int64))
    token_bytes = tokens.tobytes()
    atomic_write_bytes(root / docs_name, docs)
    atomic_write_bytes(root / bin_name, token_bytes)
    return {
        "file": bin_name,
        "docs": docs_name,
        "num_tokens": int(len(tokens)),
        "num_documents": int(len(doc_lengths)),
        "max_token_id": int(tokens.max()) if len(tokens) else -1,
        "sha256": _sha256(token_bytes),
        "head_sha256": _sha256(token_bytes[:HEAD_BYTES]),
        "docs_sha256": _sha256(docs),
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
        raise FileNotFoundError(
            f"{root} is not a complete prepared dataset: no {META_FILE}{hint}; give a directory "
            "written by `densetrain data prepare`"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{meta_path} is not valid JSON ({error}); the dataset's metadata "
                               "is damaged: prepare the dataset again") from error
    found = meta.get("format") if isinstance(meta, dict) else None
    if found == FORMAT_WITHOUT_CHECKSUMS:
        warnings.warn(
            f"{root} was prepared without shard checksums ({found}); its shards cannot be "
            "verified: prepare it again to add them",
            stacklevel=2,
        )
    elif found != FORMAT:
        raise UserError(f"{meta_path}: format {found!r}, expected {FORMAT!r} (a dataset written "
                        "by `densetrain data prepare`)")
    return meta


def _check_shard_cheaply(root: Path, entry: dict, itemsize: int) -> np.ndarray:
    """Size and first bytes of the token file, hash of the index; the document lengths."""
    path, docs_path = root / entry["file"], root / entry["docs"]
    expected = entry["num_tokens"] * itemsize
    if not path.is_file():
        raise DamagedFileError(f"shard {path} is missing ({root / META_FILE} lists it)")
    if path.stat().st_size != expected:
        raise DamagedFileError(
            f"shard {path} holds {path.stat().st_size} bytes, {root / META_FILE} says {expected}; "
            "the file is truncated or from another dataset: prepare the dataset again"
        )
    if not docs_path.is_file():
        raise DamagedFileError(f"document index {docs_path} is missing")
    docs = docs_path.read_bytes()
    if "sha256" in entry:  # absent in FORMAT_WITHOUT_CHECKSUMS datasets (warned at load)
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
        for name, data, key in ((path, head, "head_sha256"), (docs_path, docs, "docs_sha256")):
            if _sha256(data) != entry[key]:
                raise DamagedFileError(
                    f"{name} does not match its checksum in {root / META_FILE} ({key}); the "
                    "file was changed or replaced (e.g. by a shard of another dataset or "
                    "tokenizer): prepare the dataset again"
                )
    lengths = np.load(io.BytesIO(docs), allow_pickle=False)
    if int(lengths.sum()) != entry["num_tokens"]:
        raise DamagedFileError(f"document index {docs_path} does not add up to the shard's "
                               f"{entry['num_tokens']} tokens")
    return lengths


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _tokenizer_problems(root: Path, meta: dict) -> list[str]:
    """The dataset's tokenizer copy must be the one its shards were tokenized with."""
    from densetrain.data.tokenizer import load_tokenizer

    path = root / meta["tokenizer"]["file"]
    try:
        found = load_tokenizer(path).fingerprint
    except (OSError, ValueError) as error:
        return [str(error)]
    if found != meta["tokenizer"]["fingerprint"]:
        return [f"tokenizer {path} is not the one the shards were tokenized with (fingerprint "
                f"{found[:12]}, {META_FILE} says {meta['tokenizer']['fingerprint'][:12]})"]
    return []


def verify_dataset(root: str | os.PathLike) -> dict:
    """Hash every shard and index of a prepared dataset against ``meta.json`` (streaming).

    Returns ``{"shards", "bytes", "seconds"}``; raises `DamagedFileError` naming every file
    that is missing, of the wrong size or whose SHA-256 differs.
    """
    root = Path(root)
    meta = load_metadata(root)
    dtype = np.dtype(meta["dtype"])
    start, total, problems, count = time.perf_counter(), 0, [], 0
    for split in meta["splits"].values():
        for entry in split["shards"]:
            count += 1
            try:
                _check_shard_cheaply(root, entry, dtype.itemsize)
            except DamagedFileError as error:
                problems.append(str(error))
                continue
            if "sha256" not in entry:
                problems.append(f"{root / entry['file']}: no checksum recorded "
                                f"({FORMAT_WITHOUT_CHECKSUMS} dataset)")
            elif _file_sha256(root / entry["file"]) != entry["sha256"]:
                problems.append(f"shard {root / entry['file']} does not match its SHA-256 in "
                                f"{root / META_FILE}")
            total += (root / entry["file"]).stat().st_size
    problems.extend(_tokenizer_problems(root, meta))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise DamagedFileError(f"{root}: {len(problems)} damaged files: "
                               + "; ".join(problems[:5]) + more)
    return {"shards": count, "bytes": total, "seconds": time.perf_counter() - start}


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
                raise DamagedFileError(
                    f"{self.root / entry['file']}: token id {entry['max_token_id']} exceeds "
                    f"{self.dtype} (max {limit})"
                )
            doc_lengths.append(_check_shard_cheaply(self.root, entry, self.dtype.itemsize))
            path = self.root / entry["file"]
            self._arrays.append(
                np.memmap(path, dtype=self.dtype, mode="r") if entry["num_tokens"] else
                np.zeros(0, dtype=self.dtype)
            )
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
