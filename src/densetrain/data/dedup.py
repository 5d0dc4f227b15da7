"""Deduplication: exact (hash of normalised text) and near-duplicate (MinHash LSH).

MinHash (Broder 1997) estimates the Jaccard similarity of two documents' word-shingle sets; LSH
banding (Leskovec et al., *Mining of Massive Datasets*, ch. 3) finds candidate pairs without
comparing all pairs: ``bands`` bands of ``num_perm // bands`` rows collide for a pair of Jaccard
``s`` with probability ``1 - (1 - s^r)^b``. Candidates are kept as duplicates only when their
estimated Jaccard reaches ``threshold``. Hand-written over NumPy (no library needed for a few
dozen lines); all hashes are stable across processes, so a resumed prepare decides identically.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib
from dataclasses import dataclass

import numpy as np

from densetrain.data.hashing import mix64
from densetrain.errors import UserError

_WORDS = re.compile(r"\w+", re.UNICODE)
_SPACES = re.compile(r"\s+")


@dataclass(kw_only=True)
class MinHashConfig:
    """Near-duplicate detection settings (word shingles, permutations, LSH bands, threshold)."""

    shingle_size: int = 5
    num_perm: int = 128
    bands: int = 16
    threshold: float = 0.8
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if self.shingle_size < 1:
            raise UserError(f"minhash shingle_size must be >= 1, got {self.shingle_size}")
        if self.num_perm < 1 or self.bands < 1 or self.num_perm % self.bands:
            raise UserError(
                f"minhash num_perm ({self.num_perm}) must be a positive multiple of bands "
                f"({self.bands})"
            )
        if not (0.0 < self.threshold <= 1.0):
            raise UserError(f"minhash threshold must be in (0, 1], got {self.threshold}")


def normalized_hash(text: str) -> int:
    """64-bit hash of ``text`` after NFKC, lower-casing and whitespace collapsing."""
    normal = _SPACES.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()
    return int.from_bytes(hashlib.blake2b(normal.encode("utf-8"), digest_size=8).digest(), "little")


class ExactDeduplicator:
    """Remembers normalised hashes; ``is_duplicate`` is true for a text seen before."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.new_hashes: list[int] = []

    def is_duplicate(self, text: str) -> bool:
        """True if an equal (normalised) text was seen; otherwise remember it and return False."""
        return self.is_duplicate_key(normalized_hash(text))

    def is_duplicate_key(self, key: int) -> bool:
        """`is_duplicate` for a precomputed `normalized_hash` (the scale-out decision uses it)."""
        if key in self.seen:
            return True
        self.seen.add(key)
        self.new_hashes.append(key)
        return False


def _shingle_hashes(text: str, size: int) -> np.ndarray:
    """64-bit hashes of the word ``size``-grams of ``text`` (lower-cased words)."""
    words = _WORDS.findall(text.lower())
    if not words:
        return np.zeros(1, dtype=np.uint64)
    word_hashes = np.fromiter((zlib.crc32(w.encode()) for w in words), np.uint64, len(words))
    if len(words) < size:
        size = len(words)
    count = len(words) - size + 1
    combined = np.zeros(count, dtype=np.uint64)
    for offset in range(size):  # polynomial combination, wraps modulo 2^64
        combined = combined * np.uint64(1_000_003) + word_hashes[offset : offset + count]
    return np.unique(mix64(combined))


class MinHashDeduplicator:
    """MinHash signatures with an LSH band index over the kept documents."""

    def __init__(self, cfg: MinHashConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        # One salted SplitMix64 per permutation: closer to min-wise independent than the
        # linear (a*x + b) mod p family, whose estimates were visibly over-dispersed here.
        self._salts = rng.integers(0, 1 << 63, size=(cfg.num_perm, 1), dtype=np.uint64)
        self._rows = cfg.num_perm // cfg.bands
        self.tables: list[dict[int, list[int]]] = [{} for _ in range(cfg.bands)]
        self.signatures: list[np.ndarray] = []
        self.new_signatures: list[np.ndarray] = []

    def signature(self, text: str) -> np.ndarray:
        """The ``num_perm`` MinHash values of ``text`` (uint32)."""
        shingles = _shingle_hashes(text, self.cfg.shingle_size)
        out = np.empty(self.cfg.num_perm, dtype=np.uint32)
        for start in range(0, len(shingles), 4096):  # bound the [num_perm, n] temporary
            block = shingles[start : start + 4096][None, :]
            values = mix64(block ^ self._salts).min(axis=1)
            values = (values >> np.uint64(32)).astype(np.uint32)
            out = values if start == 0 else np.minimum(out, values)
        return out

    def _band_keys(self, sig: np.ndarray) -> list[int]:
        rows = self._rows
        return [
            zlib.crc32(sig[i * rows : (i + 1) * rows].tobytes(), i) for i in range(self.cfg.bands)
        ]

    def _add(self, sig: np.ndarray, keys: list[int]) -> None:
        index = len(self.signatures)
        self.signatures.append(sig)
        for table, key in zip(self.tables, keys, strict=True):
            table.setdefault(key, []).append(index)

    def is_duplicate(self, text: str) -> bool:
        """True if a kept document has estimated Jaccard >= threshold; else keep this one."""
        return self.is_duplicate_signature(self.signature(text))

    def is_duplicate_signature(self, sig: np.ndarray) -> bool:
        """`is_duplicate` for a precomputed `signature` (the scale-out decision uses it)."""
        keys = self._band_keys(sig)
        candidates: set[int] = set()
        for table, key in zip(self.tables, keys, strict=True):
            candidates.update(table.get(key, ()))
        for index in candidates:
            if float(np.mean(self.signatures[index] == sig)) >= self.cfg.threshold:
                return True
        self._add(sig, keys)
        self.new_signatures.append(sig)
        return False

    def restore(self, signatures: np.ndarray) -> None:
        """Re-add previously kept signatures (``[n, num_perm]`` uint32) after a resume."""
        for sig in signatures:
            self._add(np.ascontiguousarray(sig), self._band_keys(np.ascontiguousarray(sig)))
