"""The global sample order: a pure function of (seed, global sample index).

Sample ``g`` of the run (counting sequences, not steps, so the batch size may change) maps to a
source of the mixture and to the ``k``-th sample drawn from that source; ``k`` maps to an epoch
``k // n`` and a position in that epoch's permutation of the source's ``n`` packed sequences.
Nothing depends on the number of data-parallel ranks, so the union of the rank slices of a global
batch is the same for any rank count and a run can resume on another one.

Mixtures (GPT-3's weighted sampling, Brown et al. 2020, Table 2.2): samples come in blocks of
``BLOCK`` whose per-source counts are the weights' largest-remainder apportionment of the block,
shuffled per block; so proportions hold to 1/BLOCK at every block boundary and the number of
samples drawn from each source before ``g`` is computable without replaying the run.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from densetrain.data.hashing import mix64

BLOCK = 4096


def _keys(*parts: int, count: int) -> np.ndarray:
    """``count`` uint64 keys derived from integer parts (stable across processes)."""
    text = ":".join(str(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8 * count).digest()
    return np.frombuffer(digest, dtype=np.uint64).copy()


def permute(indices: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """Image of ``indices`` (each in [0, n)) under a pseudo-random permutation of [0, n).

    A 4-round Feistel network on the smallest even-bit domain >= n, with cycle walking back into
    [0, n) (Black & Rogaway 2002). Hand-written because it gives random access to an epoch's
    order in O(1) memory, where materialising a permutation of n sequences would cost 8n bytes.
    """
    if n <= 1:
        return np.zeros_like(indices, dtype=np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    round_keys = _keys(*key, count=4)
    x = np.asarray(indices, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    while todo.any():
        y = x[todo]
        left, right = y >> shift, y & mask
        for round_key in round_keys:
            left, right = right, (left ^ mix64(right ^ round_key)) & mask
        x[todo] = (left << shift) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def apportion(weights: list[float], total: int) -> np.ndarray:
    """Largest-remainder split of ``total`` into integer counts proportional to ``weights``."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    remainder = exact - counts
    order = np.lexsort((np.arange(len(w)), -remainder))  # ties: lower source index first
    counts[order[: total - int(counts.sum())]] += 1
    return counts


class MixtureOrder:
    """Maps global sample indices to (source, k-th sample of that source); pure in (seed, g)."""

    def __init__(self, weights: list[float], seed: int) -> None:
        self.num_sources = len(weights)
        self.seed = seed
        self.counts = apportion(weights, BLOCK)
        self._block = lru_cache(maxsize=8)(self._block_layout)

    def _block_layout(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.repeat(np.arange(self.num_sources), self.counts)
        rng = np.random.default_rng([self.seed, block, 0x6D6978])
        labels = labels[rng.permutation(BLOCK)]
        ranks = np.zeros(BLOCK, dtype=np.int64)
        for source in range(self.num_sources):
            where = labels == source
            ranks[where] = np.arange(int(where.sum()))
        return labels, ranks

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source of each global index in ``g`` and its index among that source's samples."""
        g = np.asarray(g, dtype=np.int64)
        if self.num_sources == 1:
            return np.zeros_like(g), g.copy()
        sources = np.empty_like(g)
        within = np.empty_like(g)
        blocks, offsets = np.divmod(g, BLOCK)
        for block in np.unique(blocks).tolist():
            labels, ranks = self._block(block)
            here = blocks == block
            sources[here] = labels[offsets[here]]
            within[here] = block * self.counts[sources[here]] + ranks[offsets[here]]
        return sources, within

    def drawn_before(self, g: int) -> np.ndarray:
        """How many samples each source contributed to global indices ``[0, g)``."""
        if self.num_sources == 1:
            return np.array([g], dtype=np.int64)
        block, offset = divmod(g, BLOCK)
        drawn = self.counts * block
        if offset:
            labels, _ = self._block(block)
            drawn = drawn + np.bincount(labels[:offset], minlength=self.num_sources)
        return drawn
