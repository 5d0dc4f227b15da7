"""Log-likelihood scoring of token segments: the one primitive behind perplexity and tasks.

A ``Segment`` is a token list whose first ``len - 1`` tokens are the model input and whose last
``num_scored`` targets (the input shifted by one) are scored. ``LogLikelihoodScorer`` packs
segments into rows of at most ``max_len`` input tokens (several short segments share a row and
are kept apart by the model's document masking, which also restarts their positions), runs rows
in batches under ``torch.no_grad()`` and projects to the vocabulary only at scored positions, a
chunk at a time, so full [B, S, V] logits never exist.

``rolling_segments`` cuts a long token sequence into windows the way lm-evaluation-harness's
``loglikelihood_rolling`` does (every token predicted exactly once, each window given the
longest context that fits), generalised with a ``stride``: after the first window each window
scores ``stride`` new tokens with ``max_len - stride`` or more tokens of context (the sliding
window of the Hugging Face "perplexity of fixed-length models" guide).

Shape legend: B rows, S row length, N scored tokens, C tokens in a chunk, E hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from densetrain.errors import UserError


@dataclass(frozen=True)
class Segment:
    """``tokens`` = inputs + the last target; the last ``num_scored`` targets are scored."""

    tokens: Sequence[int]
    num_scored: int

    def __post_init__(self) -> None:
        if len(self.tokens) < 2:
            raise ValueError(f"a segment needs at least 2 tokens, got {len(self.tokens)}")
        if not 1 <= self.num_scored <= len(self.tokens) - 1:
            raise ValueError(
                f"num_scored must be in [1, {len(self.tokens) - 1}] for a segment of "
                f"{len(self.tokens)} tokens, got {self.num_scored}"
            )


@dataclass(frozen=True)
class SegmentScore:
    """Sum of natural-log probabilities of the scored tokens, their number, and whether each
    of them was the model's most likely token (greedy decoding would produce them)."""

    logprob: float
    num_tokens: int
    is_greedy: bool


def rolling_segments(
    token_ids: Sequence[int], *, prefix_id: int, max_len: int, stride: int | None = None
) -> list[Segment]:
    """Windows that score every token of ``token_ids`` exactly once, given ``prefix_id`` first.

    The first window scores up to ``max_len`` tokens; each later one scores up to ``stride``
    (default ``max_len``: disjoint windows) and is given the ``max_len`` tokens before its last
    target as input, so the last window also gets a full context.
    """
    stride = max_len if stride is None else stride
    if max_len < 1:
        raise UserError(f"max_len must be >= 1, got {max_len}")
    if not 1 <= stride <= max_len:
        raise UserError(f"stride must be in [1, max_len={max_len}], got {stride}")
    sequence = [int(prefix_id), *token_ids]
    segments = []
    first, block = 1, max_len
    while first < len(sequence):
        end = min(first + block, len(sequence))
        start = max(0, end - 1 - max_len)
        segments.append(Segment(tokens=sequence[start:end], num_scored=end - first))
        first, block = end, stride
    return segments


class LogLikelihoodScorer:
    """Scores ``Segment``s with a densetrain ``Transformer`` (packed rows, batched, no grad)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_len: int | None = None,
        batch_size: int = 8,
        logits_chunk_tokens: int = 2048,
    ) -> None:
        cfg = model.config
        self.model = model
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len < 1:
            raise UserError(f"max_len must be >= 1, got {self.max_len}")
        if cfg.position_embedding == "learned" and self.max_len > cfg.max_seq_len:
            raise UserError(
                f"max_len {self.max_len} exceeds max_seq_len {cfg.max_seq_len} of a model with "
                "learned positions"
            )
        if batch_size < 1 or logits_chunk_tokens < 1:
            raise UserError(
                f"batch_size and logits_chunk_tokens must be >= 1, got {batch_size} and "
                f"{logits_chunk_tokens}"
            )
        self.batch_size = batch_size
        self.logits_chunk_tokens = logits_chunk_tokens
        self.device = next(model.parameters()).device
        self.vocab_size = cfg.vocab_size

    def score(self, segments: Iterable[Segment]) -> Iterator[SegmentScore]:
        """Scores of ``segments``, in order, computed lazily a batch of rows at a time."""
        rows: list[list[Segment]] = []
        row: list[Segment] = []
        row_len = 0
        for segment in segments:
            length = len(segment.tokens) - 1
            if length > self.max_len:
                raise ValueError(
                    f"segment of {length} input tokens is longer than max_len {self.max_len}"
                )
            if row and row_len + length > self.max_len:
                rows.append(row)
                row, row_len = [], 0
                if len(rows) == self.batch_size:
                    yield from self._score_rows(rows)
                    rows = []
            row.append(segment)
            row_len += length
        if row:
            rows.append(row)
        if rows:
            yield from self._score_rows(rows)

    def score_all(self, segments: Iterable[Segment]) -> list[SegmentScore]:
        """``list(score(segments))``."""
        return list(self.score(segments))

    @torch.no_grad()
    def _score_rows(self, rows: list[list[Segment]]) -> list[SegmentScore]:
        width = max(sum(len(s.tokens) - 1 for s in row) for row in rows)
        tokens_BS = torch.zeros(len(rows), width, dtype=torch.long)
        targets_BS = torch.zeros(len(rows), width, dtype=torch.long)
        scored_BS = torch.zeros(len(rows), width, dtype=torch.bool)
        segment_BS = torch.full((len(rows), width), -1, dtype=torch.long)
        document_BS = torch.zeros(len(rows), width, dtype=torch.long)
        index = 0
        for b, row in enumerate(rows):
            offset = 0
            for position, segment in enumerate(row):
                ids = torch.as_tensor(list(segment.tokens), dtype=torch.long)
                length = len(ids) - 1
                tokens_BS[b, offset : offset + length] = ids[:-1]
                targets_BS[b, offset : offset + length] = ids[1:]
                first_scored = offset + length - segment.num_scored
                scored_BS[b, first_scored : offset + length] = True
                segment_BS[b, offset : offset + length] = index
                document_BS[b, offset : offset + length] = position
                offset += length
                index += 1
            document_BS[b, offset:] = len(row)  # padding: a document of its own
        largest = max(int(tokens_BS.max()), int(targets_BS.max()))
        if largest >= self.vocab_size:
            raise UserError(
                f"token id {largest} is outside the model's vocabulary ({self.vocab_size}); "
                "was the text encoded with the model's tokenizer?"
            )
        packed = any(len(row) > 1 for row in rows)
        was_training = self.model.training
        self.model.eval()
        try:
            hidden_BSE = self.model.forward_hidden(
                tokens_BS.to(self.device),
                document_ids_BS=document_BS.to(self.device) if packed else None,
            )
        finally:
            self.model.train(was_training)
        mask_BS = scored_BS.to(self.device)
        logprob_N, greedy_N = self._target_logprobs(
            hidden_BSE[mask_BS], targets_BS[scored_BS].to(self.device)
        )
        owner_N = segment_BS[scored_BS]
        logprob_sums = torch.zeros(index, dtype=torch.float64).index_add_(
            0, owner_N, logprob_N.double().cpu()
        )
        misses = torch.zeros(index, dtype=torch.long).index_add_(
            0, owner_N, (~greedy_N).long().cpu()
        )
        counts = torch.bincount(owner_N, minlength=index)
        return [
            SegmentScore(float(logprob_sums[i]), int(counts[i]), bool(misses[i] == 0))
            for i in range(index)
        ]

    def _target_logprobs(
        self, hidden_NE: torch.Tensor, targets_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) in fp32 and whether the target is the argmax, a chunk at a time."""
        logprobs, greedy = [], []
        for start in range(0, hidden_NE.shape[0], self.logits_chunk_tokens):
            logits_CV = self.model.logits(hidden_NE[start : start + self.logits_chunk_tokens])
            logits_CV = logits_CV.float()
            t_C = targets_N[start : start + self.logits_chunk_tokens]
            target_C = logits_CV.gather(1, t_C.unsqueeze(1)).squeeze(1)
            logprobs.append(target_C - torch.logsumexp(logits_CV, dim=-1))
            greedy.append(logits_CV.argmax(dim=-1) == t_C)
        if not logprobs:
            empty = torch.zeros(0, device=hidden_NE.device)
            return empty, empty.bool()
        return torch.cat(logprobs), torch.cat(greedy)
