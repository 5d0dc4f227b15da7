"""The three phases of a scaled-out ``prepare``, each a pure function of its inputs.

1. **scan** (one task per worker, over a contiguous range of input files): read, filter, hash
   (exact and MinHash signature), split and tokenize every document; write per-document arrays
   and the tokens of every document that survived the filters.
2. **decide** (one task): walk the scan results of all workers in input order and make the
   global dedup decisions with the very same `ExactDeduplicator` / `MinHashDeduplicator` the
   single-process path uses, then replay the single-process batching rule (``batch_bytes`` of
   text per batch, a commit once ``shard_tokens`` train tokens are buffered) to fix which kept
   documents go into which shard. Nothing here depends on the number of workers.
3. **write** (one task per worker, over commits ``c`` with ``c % workers == rank``): copy the
   kept documents' tokens into the shard files.

A final merge (`densetrain.data.scaleout`) writes ``progress.json`` and ``meta.json`` exactly as
the single-process path does. Every file is written to a temporary name and renamed; a task's
JSON file, written last, marks it complete, so a rerun skips completed tasks.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np

from densetrain.data.dedup import ExactDeduplicator, MinHashDeduplicator, normalized_hash
from densetrain.data.filters import quality_reason
from densetrain.data.prepare import (
    WORK_DIR,  # noqa: F401 - where these phases work
    PrepareConfig,
    is_validation_document,
)
from densetrain.data.shards import (
    atomic_write_bytes,
    atomic_write_json,
    dtype_for_vocab,
    npy_bytes,
    write_shard,
)
from densetrain.data.sources import ReadStats, describe_sources, iter_documents
from densetrain.data.tokenizer import Tokenizer
from densetrain.errors import UserError

KEPT, EMPTY = 0, 1  # document status codes of a scan; quality reason i is 2 + i
TRAIN, VAL, REMOVED = 0, 1, 2  # document fate codes of the decision


def scan_path(work: Path, rank: int, suffix: str) -> Path:
    """A file of worker ``rank``'s scan (``suffix`` like ``json`` or ``tokens.bin``)."""
    return work / "scan" / f"{rank:05d}.{suffix}"


def _check_ids(flat: np.ndarray, vocab_size: int, dtype: np.dtype) -> None:
    """The single-process check: every id inside the vocabulary and the shard dtype."""
    if not len(flat):
        return
    top, low = int(flat.max()), int(flat.min())
    if top >= vocab_size or top > np.iinfo(dtype).max or low < 0:
        raise UserError(
            f"token id {top if low >= 0 else low} is outside the tokenizer's vocabulary "
            f"({vocab_size}) or the shard dtype {dtype}; no shard was written for these documents"
        )


class _ScanArrays:
    """Per-document results of one scan, growing batch by batch."""

    def __init__(self, cfg: PrepareConfig) -> None:
        self.cfg = cfg
        self.near = MinHashDeduplicator(cfg.minhash) if cfg.near_dedup else None
        self.reasons: list[str] = []
        self.chars: list[int] = []
        self.status: list[int] = []
        self.is_val: list[bool] = []
        self.exact: list[int] = []
        self.num_tokens: list[int] = []
        self.signatures: list[np.ndarray] = []

    def _status(self, text: str) -> int:
        if not text.strip():
            return EMPTY
        if self.cfg.quality_filter:
            reason = quality_reason(text, self.cfg.quality)
            if reason is not None:
                if reason not in self.reasons:
                    self.reasons.append(reason)
                return 2 + self.reasons.index(reason)
        return KEPT

    def add_batch(self, texts: list[str], tok: Tokenizer, dtype: np.dtype) -> np.ndarray:
        """Classify ``texts``; return the tokens (EOS after each) of the ones the filters keep."""
        kept = []
        for text in texts:
            status = self._status(text)
            self.chars.append(len(text))
            self.status.append(status)
            self.is_val.append(status == KEPT and is_validation_document(
                text, self.cfg.val_fraction))
            self.exact.append(normalized_hash(text) if status == KEPT and self.cfg.exact_dedup
                              else 0)
            if status == KEPT:
                kept.append(text)
                if self.near is not None:
                    self.signatures.append(self.near.signature(text))
        counts = [0] * len(texts)
        if not kept:
            self.num_tokens.extend(counts)
            return np.zeros(0, dtype)
        token_lists = tok.encode_batch(kept)
        for ids in token_lists:
            ids.append(tok.eos_id)
        lengths = iter(len(ids) for ids in token_lists)
        statuses = self.status[len(self.status) - len(texts):]
        self.num_tokens.extend(next(lengths) if s == KEPT else 0 for s in statuses)
        flat = np.fromiter((i for ids in token_lists for i in ids), np.int64)
        _check_ids(flat, tok.vocab_size, dtype)
        return flat.astype(dtype)

    def save(self, work: Path, rank: int) -> None:
        """Write the per-document arrays of worker ``rank`` (each atomically)."""
        num_perm = self.cfg.minhash.num_perm
        arrays = {
            "chars": np.asarray(self.chars, np.int64),
            "status": np.asarray(self.status, np.int16),
            "val": np.asarray(self.is_val, bool),
            "exact": np.asarray(self.exact, np.uint64),
            "ntokens": np.asarray(self.num_tokens, np.int64),
            "minhash": np.stack(self.signatures) if self.signatures
            else np.zeros((0, num_perm), np.uint32),
        }
        for name, array in arrays.items():
            atomic_write_bytes(scan_path(work, rank, f"{name}.npy"), npy_bytes(array))


def run_scan(work: Path, rank: int, files: list[Path], tok: Tokenizer, cfg: PrepareConfig) -> None:
    """Phase 1 for worker ``rank`` over ``files`` (skipped when already complete)."""
    if scan_path(work, rank, "json").is_file():
        return
    (work / "scan").mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(tok.vocab_size)
    stats = ReadStats()
    arrays = _ScanArrays(cfg)
    tokens_path = scan_path(work, rank, "tokens.bin")
    tmp = tokens_path.with_name(tokens_path.name + ".tmp")
    documents = iter_documents(files, text_field=cfg.text_field, on_bad_line=cfg.on_bad_line,
                               text_separator=cfg.text_separator, stats=stats)
    with open(tmp, "wb") as out:
        batch: list[str] = []
        size = 0
        for text in documents:
            batch.append(text)
            size += len(text)
            if size >= cfg.batch_bytes:
                out.write(arrays.add_batch(batch, tok, dtype).tobytes())
                batch, size = [], 0
        if batch:
            out.write(arrays.add_batch(batch, tok, dtype).tobytes())
    tmp.replace(tokens_path)
    arrays.save(work, rank)
    atomic_write_json(scan_path(work, rank, "json"), {
        "read": stats.as_dict(), "sources": describe_sources(files), "reasons": arrays.reasons,
    })


def _load_scan(work: Path, rank: int) -> dict:
    """A worker's scan: per-document columns as Python lists (the decide loop reads them one
    value at a time), the signatures memory-mapped."""
    scan = json.loads(scan_path(work, rank, "json").read_text())
    for name in ("chars", "status", "val", "exact", "ntokens"):
        scan[name] = np.load(scan_path(work, rank, f"{name}.npy")).tolist()
    scan["minhash"] = np.load(scan_path(work, rank, "minhash.npy"), mmap_mode="r")
    return scan


class _Decision:
    """The global dedup decisions and the single-process commit schedule (phase 2 state)."""

    def __init__(self, cfg: PrepareConfig) -> None:
        self.cfg = cfg
        self.exact = ExactDeduplicator() if cfg.exact_dedup else None
        self.near = MinHashDeduplicator(cfg.minhash) if cfg.near_dedup else None
        self.removed: Counter = Counter()
        self.kept = {"train": 0, "val": 0}
        self.fates: list[np.ndarray] = []
        self.commits: list[dict] = []  # per commit: end document, has train/val, dedup state
        self.buffered = {"train": 0, "val": 0}

    def _fate(self, scan: dict, doc: int, candidate: int) -> int:
        status = scan["status"][doc]
        if status != KEPT:
            self.removed["empty" if status == EMPTY
                         else f"quality:{scan['reasons'][status - 2]}"] += 1
            return REMOVED
        if self.exact is not None and self.exact.is_duplicate_key(scan["exact"][doc]):
            self.removed["exact_duplicate"] += 1
            return REMOVED
        if self.near is not None and self.near.is_duplicate_signature(
            np.array(scan["minhash"][candidate])
        ):
            self.removed["near_duplicate"] += 1
            return REMOVED
        split = "val" if scan["val"][doc] else "train"
        self.kept[split] += 1
        self.buffered[split] += scan["ntokens"][doc]
        return VAL if split == "val" else TRAIN

    def commit(self, end: int) -> None:
        """Close a commit at global document ``end`` (exclusive), as `_Preparer.commit` does."""
        new_minhash = self.near.new_signatures if self.near is not None else []
        self.commits.append({
            "end": end, "train": self.buffered["train"] > 0, "val": self.buffered["val"] > 0,
            "exact": np.asarray(self.exact.new_hashes if self.exact else [], np.uint64),
            "minhash": np.stack(new_minhash) if new_minhash
            else np.zeros((0, self.cfg.minhash.num_perm), np.uint32),
        })
        self.buffered = {"train": 0, "val": 0}
        if self.exact is not None:
            self.exact.new_hashes.clear()
        if self.near is not None:
            self.near.new_signatures.clear()

    def walk(self, scans: list[dict]) -> int:
        """Decide every document in input order, committing as the single-process path does."""
        doc_index, batch_chars = 0, 0
        for scan in scans:
            fates = np.empty(len(scan["chars"]), np.int8)
            candidate = 0
            for doc in range(len(fates)):
                fates[doc] = self._fate(scan, doc, candidate)
                candidate += scan["status"][doc] == KEPT
                doc_index += 1
                batch_chars += scan["chars"][doc]
                if batch_chars >= self.cfg.batch_bytes:
                    batch_chars = 0
                    if self.buffered["train"] >= self.cfg.shard_tokens:
                        self.commit(doc_index)
            self.fates.append(fates)
        self.commit(doc_index)  # the last (possibly partial) batch, always committed
        return doc_index


def run_decide(work: Path, workers: int, cfg: PrepareConfig) -> None:
    """Phase 2: global decisions and commit schedule into ``work/decide`` (skipped if done)."""
    done = work / "decide" / "plan.json"
    if done.is_file():
        return
    (work / "decide").mkdir(parents=True, exist_ok=True)
    scans = [_load_scan(work, rank) for rank in range(workers)]
    decision = _Decision(cfg)
    total = decision.walk(scans)
    for rank, fates in enumerate(decision.fates):
        atomic_write_bytes(work / "decide" / f"{rank:05d}.fates.npy", npy_bytes(fates))
    commits = []
    for index, commit in enumerate(decision.commits):
        if cfg.exact_dedup or cfg.near_dedup:
            buffer = io.BytesIO()
            np.savez(buffer, exact=commit["exact"], minhash=commit["minhash"])
            atomic_write_bytes(work / "decide" / f"{index:05d}.npz", buffer.getvalue())
        commits.append({k: commit[k] for k in ("end", "train", "val")})
    atomic_write_json(done, {
        "documents": total, "commits": commits, "removed": dict(decision.removed),
        "kept_documents": decision.kept,
    })


def _gather(work: Path, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """Global per-document fate, token count and token offset, and each worker's token file."""
    fates = [np.load(work / "decide" / f"{r:05d}.fates.npy") for r in range(workers)]
    counts = [np.load(scan_path(work, r, "ntokens.npy")) for r in range(workers)]
    owner = np.concatenate([np.full(len(f), r, np.int64) for r, f in enumerate(fates)]
                           or [np.zeros(0, np.int64)])
    offsets = np.concatenate([np.cumsum(c) - c for c in counts] or [np.zeros(0, np.int64)])
    return (np.concatenate(fates or [np.zeros(0, np.int8)]),
            np.concatenate(counts or [np.zeros(0, np.int64)]), offsets, owner)


def run_write(work: Path, out: Path, rank: int, workers: int, dtype: np.dtype) -> None:
    """Phase 3 for worker ``rank``: the shards of commits ``c % workers == rank``."""
    done = work / "write" / f"{rank:05d}.json"
    if done.is_file():
        return
    (work / "write").mkdir(parents=True, exist_ok=True)
    plan = json.loads((work / "decide" / "plan.json").read_text())
    fates, counts, offsets, owner = _gather(work, workers)
    tokens = [np.memmap(scan_path(work, r, "tokens.bin"), dtype=dtype, mode="r")
              if scan_path(work, r, "tokens.bin").stat().st_size else np.zeros(0, dtype)
              for r in range(workers)]
    entries: dict[str, dict] = {}
    start = 0
    for index, commit in enumerate(plan["commits"]):
        end = commit["end"]
        if index % workers == rank:
            for split, code in (("train", TRAIN), ("val", VAL)):
                if not commit[split]:
                    continue
                docs = start + np.flatnonzero(fates[start:end] == code)
                pieces = [tokens[owner[d]][offsets[d] : offsets[d] + counts[d]] for d in docs]
                entry = write_shard(out, split, index, np.concatenate(pieces), counts[docs])
                entries[f"{split}/{index}"] = entry
        start = end
    atomic_write_json(done, entries)
