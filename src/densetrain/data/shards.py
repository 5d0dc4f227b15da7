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
`verify_dataset` (``densetrain data verify``) hashes every byte. ``meta.json`` itself is checked
field by field on load (`check_metadata`), and every batch's token ids against the tokenizer's
vocabulary (`TokenStore.check_ids`), so a flipped byte past the first 64 KiB is named (shard,
offset) instead of indexing past the embedding.
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

from densetrain.errors import (
    DamagedFileError,
    UserError,
    UserFileNotFoundError,
    UserNotADirectoryError,
)

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
    raise UserError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


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
    """The ``meta.json`` of a complete prepared dataset, its fields and types checked once
    (`check_metadata`); clear errors when missing, incomplete or damaged."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserNotADirectoryError(
            f"{root} is a file, not a directory; give a prepared dataset directory (one written "
            "by `densetrain data prepare`)"
        )
    if not root.is_dir():
        raise UserFileNotFoundError(f"prepared dataset directory {root} does not exist")
    meta_path = root / META_FILE
    if not meta_path.is_file():
        interrupted = (root / "progress.json").exists()
        hint = " (an interrupted prepare: rerun it to finish)" if interrupted else ""
        raise UserFileNotFoundError(
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
    check_metadata(meta, meta_path)
    return meta


TOKEN_DTYPES = ("uint16", "uint32")
_MISSING = object()
_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "an integer", float: "a number"}


def _shown(value: object) -> str:
    if value is None:
        return "null"
    text = json.dumps(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({_JSON_KINDS.get(type(value), type(value).__name__)})"


def _meta_error(meta_path: Path, where: str, value: object, expected: str) -> DamagedFileError:
    held = "is missing" if value is _MISSING else f"holds {_shown(value)}"
    return DamagedFileError(
        f"{meta_path}: {where} {held}, expected {expected}; the dataset's metadata is damaged "
        "or was edited: restore it or prepare the dataset again"
    )


def _is_count(value: object, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_inner_path(value: object) -> bool:
    """A relative path that stays inside the dataset directory."""
    return (isinstance(value, str) and bool(value) and not Path(value).is_absolute()
            and ".." not in Path(value).parts)


def _is_sha256(value: object) -> bool:
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value))


_PATH = "a relative path inside the dataset directory"
_COUNT = "an integer >= 0"
_HASH = "a SHA-256 (64 hex digits)"


def check_metadata(meta: object, meta_path: Path) -> None:
    """`DamagedFileError` naming ``meta_path``, the key, what it holds and what was expected
    when a field the readers use is missing or of the wrong type, or two fields disagree."""

    def field(obj: dict, key: str, where: str, ok, expected: str):
        value = obj.get(key, _MISSING)
        if value is _MISSING or not ok(value):
            raise _meta_error(meta_path, where, value, expected)
        return value

    def is_object(value: object) -> bool:
        return isinstance(value, dict)

    if not isinstance(meta, dict):
        raise _meta_error(meta_path, "the top level", meta, "an object")
    with_checksums = meta.get("format") == FORMAT
    dtype = field(meta, "dtype", "dtype", lambda v: v in TOKEN_DTYPES,
                  " or ".join(repr(d) for d in TOKEN_DTYPES))
    id_limit = int(np.iinfo(np.dtype(dtype)).max) + 1
    tokenizer = field(meta, "tokenizer", "tokenizer", is_object, "an object")
    field(tokenizer, "file", "tokenizer.file", _is_inner_path, _PATH)
    field(tokenizer, "fingerprint", "tokenizer.fingerprint", lambda v: isinstance(v, str) and v,
          "a non-empty string")
    vocab_size = field(tokenizer, "vocab_size", "tokenizer.vocab_size",
                       lambda v: _is_count(v, 1) and v <= id_limit,
                       f"an integer in [1, {id_limit}] ({dtype} ids)")
    field(tokenizer, "eos_id", "tokenizer.eos_id", lambda v: _is_count(v) and v < vocab_size,
          f"an integer in [0, {vocab_size}) (below tokenizer.vocab_size)")
    counts = field(meta, "counts", "counts", is_object, "an object")
    for key in ("read", "removed"):
        field(counts, key, f"counts.{key}", is_object, "an object")
    splits = field(meta, "splits", "splits", is_object, 'an object of splits ("train", "val")')
    for name, split in splits.items():
        where = f"splits.{name}"
        if not isinstance(split, dict):
            raise _meta_error(meta_path, where, split, "an object with shards, num_tokens and "
                              "num_documents")
        shards = field(split, "shards", f"{where}.shards", lambda v: isinstance(v, list),
                       "an array of shard entries")
        totals = {"num_tokens": 0, "num_documents": 0}
        for i, entry in enumerate(shards):
            at = f"{where}.shards[{i}]"
            if not isinstance(entry, dict):
                raise _meta_error(meta_path, at, entry, "an object describing one shard")
            for key in ("file", "docs"):
                field(entry, key, f"{at}.{key}", _is_inner_path, _PATH)
            for key in totals:
                totals[key] += field(entry, key, f"{at}.{key}", _is_count, _COUNT)
            max_id = field(entry, "max_token_id", f"{at}.max_token_id", lambda v: _is_count(v, -1),
                           "an integer >= -1 (-1: an empty shard)")
            if max_id >= vocab_size:
                raise DamagedFileError(
                    f"{meta_path}: tokenizer.vocab_size is {vocab_size} but {at}.max_token_id "
                    f"is {max_id} (shard {entry['file']} holds ids up to {max_id}): the two "
                    "disagree; the dataset's metadata is damaged or was edited: restore it or "
                    "prepare the dataset again"
                )
            if with_checksums:
                for key in ("sha256", "head_sha256", "docs_sha256"):
                    field(entry, key, f"{at}.{key}", _is_sha256, _HASH)
        for key, total in totals.items():
            field(split, key, f"{where}.{key}", lambda v, t=total: _is_count(v) and v == t,
                  f"{total} (the sum of its shards' {key})")


def load_dataset_tokenizer(root: str | os.PathLike, meta: dict):
    """The tokenizer copy stored in dataset ``root``; `DamagedFileError` when it is not the one
    ``meta`` (its ``meta.json``) records (other fingerprint or vocabulary size)."""
    from densetrain.data.tokenizer import load_tokenizer

    root = Path(root)
    recorded = meta["tokenizer"]
    tokenizer = load_tokenizer(root / recorded["file"])
    if tokenizer.fingerprint != recorded["fingerprint"]:
        raise DamagedFileError(
            f"tokenizer {tokenizer.path} is not the one the shards were tokenized with "
            f"(fingerprint {tokenizer.fingerprint[:12]}, {root / META_FILE} says "
            f"{recorded['fingerprint'][:12]}); restore it or prepare the dataset again"
        )
    if tokenizer.vocab_size != recorded["vocab_size"]:
        raise DamagedFileError(
            f"{root / META_FILE}: tokenizer.vocab_size is {recorded['vocab_size']} but the "
            f"dataset's tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids: the metadata "
            "disagrees with its own tokenizer; it is damaged or was edited: restore it or "
            "prepare the dataset again"
        )
    return tokenizer


def _check_shard_cheaply(root: Path, entry: dict, itemsize: int,
                         tokens_too: bool = True) -> np.ndarray:
    """Size and first bytes of the token file, hash of the index; the document lengths.
    ``tokens_too=False``: the index only (a remote shard, hashed whole when fetched)."""
    path, docs_path = root / entry["file"], root / entry["docs"]
    expected = entry["num_tokens"] * itemsize
    if tokens_too and not path.is_file():
        raise DamagedFileError(f"shard {path} is missing ({root / META_FILE} lists it)")
    if tokens_too and path.stat().st_size != expected:
        raise DamagedFileError(
            f"shard {path} holds {path.stat().st_size} bytes, {root / META_FILE} says {expected}; "
            "the file is truncated or from another dataset: prepare the dataset again"
        )
    if not docs_path.is_file():
        raise DamagedFileError(f"document index {docs_path} is missing")
    docs = docs_path.read_bytes()
    if "sha256" in entry:  # absent in FORMAT_WITHOUT_CHECKSUMS datasets (warned at load)
        checks = [(docs_path, docs, "docs_sha256")]
        if tokens_too:
            with open(path, "rb") as f:
                checks.append((path, f.read(HEAD_BYTES), "head_sha256"))
        for name, data, key in checks:
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
    try:
        load_dataset_tokenizer(root, meta)
    except (OSError, ValueError) as error:
        return [str(error)]
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

    def __init__(self, root: str | os.PathLike, split: str, meta: dict | None = None,
                 remote=None) -> None:
        """``remote``: a `data.remote.RemoteSplit` when ``root`` holds only the metadata and
        document indexes of a dataset under a URL; its token shards are then read through it
        (fetched, verified and cached on first use)."""
        self.root = Path(root)
        self.meta = meta if meta is not None else load_metadata(root)
        self.split = split
        self.remote = remote
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = int(self.meta["tokenizer"]["vocab_size"])
        """Ids of the dataset's tokenizer; every stored id is below it (`check_ids`)."""
        shards = self.meta["splits"].get(split, {}).get("shards", [])
        self._files = ([remote.name(i) for i in range(len(shards))] if remote is not None
                       else [self.root / entry["file"] for entry in shards])
        self._arrays: list[np.ndarray | None] = []
        doc_lengths: list[np.ndarray] = []
        for entry in shards:  # max_token_id < vocab_size <= the dtype's range: check_metadata
            doc_lengths.append(_check_shard_cheaply(self.root, entry, self.dtype.itemsize,
                                                    tokens_too=remote is None))
            path = self.root / entry["file"]
            self._arrays.append(
                np.zeros(0, dtype=self.dtype) if not entry["num_tokens"] else
                None if remote is not None else np.memmap(path, dtype=self.dtype, mode="r")
            )
        sizes = np.array([entry["num_tokens"] for entry in shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self._shard_starts[-1])
        lengths = np.concatenate(doc_lengths) if doc_lengths else np.zeros(0, dtype=np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.num_documents = int(len(lengths))

    def content_key(self) -> str:
        """16 hex digits that change whenever this split's tokens do: a SHA-256 over the
        tokenizer fingerprint and each shard's recorded SHA-256 and token count (``meta.json``;
        the shards themselves are checked against those on open and by ``data verify``). A
        dataset prepared again from other text, or with another tokenizer, gets another key
        even when its sequence count stays the same."""
        shards = self.meta["splits"].get(self.split, {}).get("shards", [])
        body = json.dumps([self.meta["tokenizer"]["fingerprint"], self.split,
                           [[entry.get("sha256"), entry["num_tokens"]] for entry in shards]])
        return hashlib.sha256(body.encode("utf-8")).hexdigest()[:16]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64 (may span shards)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self._shard_starts[shard])
            array = self._arrays[shard]
            if array is None:
                array = self.remote.array(shard)
            take = min(length - filled, len(array) - offset)
            out[filled : filled + take] = array[offset : offset + take]
            filled += take
            shard += 1
        return out

    def prefetch(self, starts: list[int], length: int) -> None:
        """Start fetching, in the background, the remote shards that reads of ``length`` tokens
        from ``starts`` need (nothing for a local dataset)."""
        if self.remote is None or not starts:
            return
        at = np.asarray(starts, dtype=np.int64)
        first = np.searchsorted(self._shard_starts, at, side="right") - 1
        last = np.searchsorted(self._shard_starts, at + length - 1, side="right") - 1
        needed = sorted({s for a, b in zip(first.tolist(), last.tolist(), strict=True)
                         for s in range(a, b + 1) if self._arrays[s] is None})
        self.remote.prefetch(needed)

    def locate(self, position: int) -> tuple[Path, int]:
        """The shard file holding token ``position`` of the stream, and its token offset there."""
        shard = int(np.searchsorted(self._shard_starts, position, side="right")) - 1
        return self._files[shard], position - int(self._shard_starts[shard])

    def bad_id_error(self, position: int, token_id: int, *, count: int = 1) -> DamagedFileError:
        """The error for token id ``token_id`` (>= ``vocab_size``) found at stream ``position``;
        ``count`` ids out of range were found in all."""
        path, offset = self.locate(position)
        more = f" ({count} such ids in the {self.split} split)" if count > 1 else ""
        return DamagedFileError(
            f"shard {path}: token id {token_id} at token offset {offset} (byte "
            f"{offset * self.dtype.itemsize}) is outside the tokenizer's vocabulary of "
            f"{self.vocab_size} ids{more}; the file was changed after it was prepared: "
            f"`densetrain data verify {self.root}` checks every byte; restore the file or prepare "
            "the dataset again"
        )

    def check_ids(self, start: int, tokens: np.ndarray) -> None:
        """`DamagedFileError` (`bad_id_error`) when ``tokens``, read from stream position
        ``start``, hold an id >= ``vocab_size`` (ids are unsigned: none is negative)."""
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            index = int(np.argmax(tokens >= self.vocab_size))
            raise self.bad_id_error(start + index, int(tokens[index]))

    def document_ids(self, start: int, length: int) -> np.ndarray:
        """Global document index of each token in ``[start, start + length)``."""
        offsets = np.arange(start, start + length, dtype=np.int64)
        return np.searchsorted(self.doc_starts, offsets, side="right") - 1
