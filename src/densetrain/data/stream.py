"""Packed batches from prepared datasets: ``Batch``, ``BatchStream``.

Each source's split is one token stream (documents separated by EOS); its ``i``-th packed
sequence is tokens ``[i*S, i*S + S + 1)``, crossing document boundaries. ``BatchStream`` reads
the rank's rows of each global batch from ``sampler`` order; its state is the number of
sequences consumed, so it resumes exactly on any rank count and with any batch-size schedule.
Ranges of that order can be skipped (``skip_ranges``, set by the trainer after a loss-spike
rollback): the batches are still a pure function of the consumed count and the ranges.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from densetrain.data.sampler import MixtureOrder, permute
from densetrain.data.shards import TokenStore
from densetrain.errors import UserError

CONTENT_KEY = "content"
"""The entry of the data loader state that holds each source's `TokenStore.content_key`."""


@dataclass(kw_only=True)
class Batch:
    """One rank's rows of a global batch (b = global_batch_size // dp_size, S = seq_len).

    ``document_ids`` numbers the documents within each row from 0; ``positions`` restart at 0
    at every document start (and at the row start). Both are None without document masking.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class RepetitionWarning(UserWarning):
    """A mixture source was repeated more epochs than ``max_epochs_warning``."""


def _segment_info(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-relative document ids and positions restarting at each document start."""
    relative = doc_ids - doc_ids[0]
    index = np.arange(len(doc_ids))
    starts = np.where(np.r_[True, doc_ids[1:] != doc_ids[:-1]], index, 0)
    return relative, index - np.maximum.accumulate(starts)


class BatchStream:
    """Deterministic, resumable stream of packed batches over a weighted mixture of sources."""

    def __init__(
        self,
        stores: list[TokenStore],
        weights: list[float],
        *,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        document_masking: bool = False,
        max_epochs_warning: float = 4.0,
        names: list[str] | None = None,
    ) -> None:
        if not (0 <= dp_rank < dp_size):
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if len(weights) != len(stores) or not stores:
            raise ValueError(f"need one weight per source: {len(stores)} sources, {weights=}")
        self.stores, self.weights = stores, [float(w) for w in weights]
        self.seq_len, self.seed = seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.document_masking = document_masking
        self.max_epochs_warning = max_epochs_warning
        self.names = names or [str(s.root) for s in stores]
        self.num_sequences = [(s.num_tokens - 1) // seq_len for s in stores]
        for name, store, count in zip(self.names, stores, self.num_sequences, strict=True):
            if count < 1:
                raise UserError(
                    f"seq_len {seq_len} is longer than dataset {name} ({store.split} split has "
                    f"{store.num_tokens} tokens; a sample needs seq_len + 1)"
                )
        self.content_keys = [s.content_key() for s in stores]
        """Per source, a key of its split's tokens (`TokenStore.content_key`): a resume on a
        dataset prepared again with the same sequence count is still refused."""
        self._vocab_sizes = np.array([s.vocab_size for s in stores], dtype=np.int64)
        self.order = MixtureOrder(self.weights, seed)
        self.consumed_sequences = 0
        self.skip_ranges: list[tuple[int, int]] = []
        """Ranges ``[start, end)`` of the global order that no batch reads (sorted, disjoint)."""
        self._warned: set[int] = set()

    def set_skip_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Never read the global sequence positions in ``ranges`` (``[start, end)`` each); a
        batch that would overlap a range starts after it instead."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if not 0 <= start < end:
                raise UserError(f"a skip range needs 0 <= start < end, got {(start, end)}")
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.skip_ranges = merged

    def next_start(self, global_batch_size: int) -> int:
        """Global position where the next batch starts: the consumed count, moved past every
        skip range the batch would overlap."""
        start = self.consumed_sequences
        for range_start, range_end in self.skip_ranges:  # sorted: one pass moves past all
            if range_start < start + global_batch_size and start < range_end:
                start = range_end
        return start

    def _rows(self, start: int, count: int) -> list[tuple[int, int]]:
        """(source, token offset) of global samples ``[start, start + count)``."""
        sources, within = self.order.locate(np.arange(start, start + count))
        sizes = np.asarray(self.num_sequences, dtype=np.int64)[sources]
        epochs, positions = np.divmod(within, sizes)
        indices = np.empty_like(positions)
        for source, epoch in sorted(set(zip(sources.tolist(), epochs.tolist(), strict=True))):
            here = (sources == source) & (epochs == epoch)
            key = (self.seed, source, epoch)
            indices[here] = permute(positions[here], self.num_sequences[source], key)
            if epoch + 1 > self.max_epochs_warning and source not in self._warned:
                self._warned.add(source)
                warnings.warn(
                    f"data source {self.names[source]} entered epoch {epoch + 1}, more than "
                    f"max_epochs_warning={self.max_epochs_warning}",
                    RepetitionWarning,
                    stacklevel=3,
                )
        offsets = indices * self.seq_len
        return list(zip(sources.tolist(), offsets.tolist(), strict=True))

    def global_rows(self, start: int, count: int) -> list[tuple[int, int]]:
        """Public view of the global order: (source, token offset) of samples start..+count."""
        return self._rows(start, count)

    def batch_at(self, start: int, global_batch_size: int) -> Batch:
        """This rank's slice of the global batch of samples ``[start, start + gbs)`` (pure)."""
        if global_batch_size < 1 or global_batch_size % self.dp_size:
            raise UserError(
                f"global_batch_size {global_batch_size} must be a positive multiple of "
                f"dp_size {self.dp_size}"
            )
        local = global_batch_size // self.dp_size
        rows = self._rows(start + self.dp_rank * local, local)
        S = self.seq_len
        tokens = np.empty((local, S + 1), dtype=np.int64)
        doc_ids = np.empty((local, S), dtype=np.int64) if self.document_masking else None
        positions = np.empty((local, S), dtype=np.int64) if self.document_masking else None
        for row, (source, offset) in enumerate(rows):
            tokens[row] = self.stores[source].read(offset, S + 1)
            if doc_ids is not None:
                ids = self.stores[source].document_ids(offset, S)
                doc_ids[row], positions[row] = _segment_info(ids)
        # A flipped byte past the part of a shard checked on open would otherwise index past
        # the embedding; one max per row is cheap next to the reads (under 1% of batch_at).
        limits = self._vocab_sizes[[source for source, _ in rows]]
        for row in np.flatnonzero(tokens.max(axis=1) >= limits).tolist()[:1]:
            source, offset = rows[row]
            self.stores[source].check_ids(offset, tokens[row])
        data = torch.from_numpy(tokens)
        return Batch(
            inputs=data[:, :-1].contiguous(),
            targets=data[:, 1:].contiguous(),
            document_ids=None if doc_ids is None else torch.from_numpy(doc_ids),
            positions=None if positions is None else torch.from_numpy(positions),
        )

    def next_batch(self, global_batch_size: int) -> Batch:
        """This rank's rows of the next global batch (past the skip ranges); advances by
        ``global_batch_size`` plus the skipped sequences."""
        start = self.next_start(global_batch_size)
        batch = self.batch_at(start, global_batch_size)
        self.consumed_sequences = start + global_batch_size
        if any(store.remote is not None for store in self.stores):
            self._prefetch(self.next_start(global_batch_size), global_batch_size)
        return batch

    def _prefetch(self, start: int, global_batch_size: int) -> None:
        """Ask remote sources for the shards of this rank's rows of the batch at ``start``
        (fetched in the background while the step runs: `data.remote`)."""
        if global_batch_size % self.dp_size:
            return  # batch_at refuses it when read
        local = global_batch_size // self.dp_size
        warned = set(self._warned)  # the read itself warns about epochs, not a lookahead
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RepetitionWarning)
            rows = self._rows(start + self.dp_rank * local, local)
        self._warned = warned
        for source, store in enumerate(self.stores):
            store.prefetch([offset for s, offset in rows if s == source], self.seq_len + 1)

    def iter_eval(self, num_batches: int, batch_size: int) -> Iterator[Batch]:
        """A fixed set of batches (the first ``num_batches`` of the order); state untouched."""
        for i in range(num_batches):
            yield self.batch_at(i * batch_size, batch_size)

    def epochs(self) -> dict[str, float]:
        """Epochs consumed so far of each source (samples drawn / packed sequences)."""
        drawn = self.order.drawn_before(self.consumed_sequences)
        return {
            name: int(d) / n
            for name, d, n in zip(self.names, drawn, self.num_sequences, strict=True)
        }

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "weights": ",".join(f"{w:.12g}" for w in self.weights),
            "num_sequences": ",".join(str(n) for n in self.num_sequences),
            "content": ",".join(self.content_keys),
        }

    def state_dict(self) -> dict:
        """Plain ints/strings, independent of the number of ranks."""
        return {"consumed_sequences": self.consumed_sequences, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``; the sources, weights, seed, seq_len and the sources'
        contents must match (`DataStateMismatchError` saying what differs). A state saved
        before contents were recorded (no ``content``) is checked on the rest."""
        for key, value in self._identity().items():
            if key == CONTENT_KEY and key not in state:
                continue
            if state.get(key) != value:
                raise DataStateMismatchError(self._mismatch(key, state.get(key)))
        consumed = int(state["consumed_sequences"])
        if consumed < 0:
            raise ValueError(f"consumed_sequences must be >= 0, got {consumed}")
        self.consumed_sequences = consumed

    def _mismatch(self, key: str, saved: object) -> str:
        """What differs between a saved data loader state and this stream, and what to do."""
        fix = ("restore the data the run was trained on, or start a new run (another "
               "--logging.run_dir, or --checkpoint.resume=false to start over in this one)")
        if key == "num_sequences":
            then = str(saved).split(",")
            if len(then) == len(self.names):
                changed = [
                    f"dataset {name} held {old} sequences of {self.seq_len} tokens when the "
                    f"checkpoint was saved and holds {now} now"
                    for name, old, now in zip(self.names, then, self.num_sequences, strict=True)
                    if old != str(now)
                ]
                return (f"{'; '.join(changed)}: the data changed since the checkpoint (its "
                        f"contents differ, e.g. it was prepared again); {fix}")
        if key == CONTENT_KEY:
            then = str(saved).split(",")
            if len(then) == len(self.names):
                changed = [name for name, old, now in zip(self.names, then, self.content_keys,
                                                          strict=True) if old != now]
                return (f"dataset {', '.join(changed)} holds other tokens than when the "
                        f"checkpoint was saved (the same number of {self.seq_len}-token "
                        "sequences, but its shards' SHA-256 or its tokenizer differ: it was "
                        f"prepared again or edited); {fix}")
        return (f"the data loader state was saved with {key} {saved} but this run has "
                f"{self._identity()[key]} (datasets {', '.join(self.names)}); resume with the "
                f"same datasets, weights, seed and seq_len, or start a new run (another "
                "--logging.run_dir, or --checkpoint.resume=false)")


class DataStateMismatchError(UserError):
    """A checkpoint's data loader state belongs to other data than the stream resuming it."""
