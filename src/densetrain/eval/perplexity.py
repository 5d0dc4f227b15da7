"""Loss, perplexity and bits per byte of a model over text files or a prepared dataset split.

Every document is scored on its own: it is preceded by one prefix token (EOS by default, as in
densetrain's prepared data where EOS separates documents; BOS for models trained that way), so
each of its tokens is predicted, and documents longer than the window are cut by
``rolling_segments`` (disjoint windows by default, a sliding window with ``stride``). The
document-end EOS itself is not scored, so the figures depend only on the text.

Reported (Gao et al. 2020, "The Pile", §5 / Appendix: bits per byte normalises by UTF-8 bytes so
that models with different tokenizers compare):

- ``loss`` = total nats / scored tokens, ``perplexity`` = exp(loss);
- ``bits_per_byte`` = total nats / (ln 2 · total UTF-8 bytes), ``byte_perplexity`` = exp(nats /
  bytes); ``word_perplexity`` = exp(nats / whitespace-separated words) (as lm-evaluation-harness
  reports for wikitext).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from densetrain.errors import UserError
from densetrain.eval.scoring import LogLikelihoodScorer, rolling_segments

_PREFIXES = ("eos", "bos")


@dataclass(kw_only=True)
class PerplexityConfig:
    """How to score.

    Attributes:
        seq_len: window length in tokens; 0 = the model's ``max_seq_len``.
        stride: new tokens scored per window after the first; 0 = ``seq_len`` (disjoint
            windows). Smaller strides give each token more context and cost more.
        batch_size: rows of ``seq_len`` tokens per forward pass (short documents share rows).
        prefix: token placed before each document: ``eos`` or ``bos``.
        max_documents: stop after this many documents; 0 = all.
        encode_batch: documents tokenized together (the tokenizer uses all cores).
    """

    seq_len: int = 0
    stride: int = 0
    batch_size: int = 8
    prefix: str = "eos"
    max_documents: int = 0
    encode_batch: int = 64

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        for name in ("seq_len", "stride", "max_documents"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("batch_size", "encode_batch"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix not in _PREFIXES:
            raise UserError(f"prefix must be one of {list(_PREFIXES)}, got {self.prefix!r}")
        if self.seq_len and self.stride > self.seq_len:
            raise UserError(f"stride {self.stride} exceeds seq_len {self.seq_len}")


@dataclass(kw_only=True)
class PerplexityResult:
    """Totals of a perplexity evaluation and the metrics derived from them."""

    nats: float
    tokens: int
    bytes: int
    words: int
    documents: int

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.nats / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        """exp(loss)."""
        return math.exp(self.loss) if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        """nats / (ln 2 · UTF-8 bytes) (The Pile, Gao et al. 2020)."""
        return self.nats / (math.log(2) * self.bytes) if self.bytes else float("nan")

    @property
    def byte_perplexity(self) -> float:
        """exp(nats / bytes)."""
        return math.exp(self.nats / self.bytes) if self.bytes else float("nan")

    @property
    def word_perplexity(self) -> float:
        """exp(nats / words)."""
        return math.exp(self.nats / self.words) if self.words else float("nan")

    def as_dict(self) -> dict:
        """Totals and metrics as a plain dict (for JSON)."""
        metrics = {
            name: getattr(self, name)
            for name in ("loss", "perplexity", "bits_per_byte", "byte_perplexity",
                         "word_perplexity")
        }
        return {**asdict(self), **metrics}


def prefix_token_id(tokenizer, prefix: str) -> int:
    """The id of the ``eos`` or ``bos`` token of ``tokenizer``; ``ValueError`` if it has none."""
    if prefix not in _PREFIXES:
        raise UserError(f"prefix must be one of {list(_PREFIXES)}, got {prefix!r}")
    token_id = tokenizer.eos_id if prefix == "eos" else tokenizer.bos_id
    if token_id is None:
        raise UserError(f"tokenizer {tokenizer.path} has no {prefix} token; use another prefix")
    return int(token_id)


def _resolved_lengths(model: torch.nn.Module, cfg: PerplexityConfig) -> tuple[int, int]:
    seq_len = cfg.seq_len or model.config.max_seq_len
    stride = cfg.stride or seq_len
    if stride > seq_len:
        raise UserError(f"stride {stride} exceeds the window of {seq_len} tokens")
    return seq_len, stride


def perplexity_of_token_documents(
    model: torch.nn.Module,
    documents: Iterable[tuple[list[int], str]],
    *,
    prefix_id: int,
    cfg: PerplexityConfig | None = None,
) -> PerplexityResult:
    """Score documents given as (token ids, text); the text gives the byte and word counts."""
    cfg = cfg or PerplexityConfig()
    cfg.validate()
    seq_len, stride = _resolved_lengths(model, cfg)
    scorer = LogLikelihoodScorer(model, max_len=seq_len, batch_size=cfg.batch_size)
    totals = {"bytes": 0, "words": 0, "documents": 0}

    def segments():
        for ids, text in documents:
            totals["documents"] += 1
            totals["bytes"] += len(text.encode("utf-8"))
            totals["words"] += len(text.split())
            yield from rolling_segments(ids, prefix_id=prefix_id, max_len=seq_len, stride=stride)

    nats, tokens = 0.0, 0
    for score in scorer.score(segments()):
        nats -= score.logprob
        tokens += score.num_tokens
    return PerplexityResult(nats=nats, tokens=tokens, **totals)


def _encoded(tokenizer, texts: Iterable[str], cfg: PerplexityConfig) -> Iterator[tuple]:
    batch: list[str] = []
    count = 0
    for text in texts:
        if cfg.max_documents and count >= cfg.max_documents:
            break
        batch.append(text)
        count += 1
        if len(batch) == cfg.encode_batch:
            yield from zip(tokenizer.encode_batch(batch), batch, strict=True)
            batch = []
    if batch:
        yield from zip(tokenizer.encode_batch(batch), batch, strict=True)


def text_perplexity(
    model: torch.nn.Module, tokenizer, texts: Iterable[str], cfg: PerplexityConfig | None = None
) -> PerplexityResult:
    """Perplexity and bits per byte of ``texts`` (each one document)."""
    cfg = cfg or PerplexityConfig()
    cfg.validate()
    prefix_id = prefix_token_id(tokenizer, cfg.prefix)
    return perplexity_of_token_documents(
        model, _encoded(tokenizer, texts, cfg), prefix_id=prefix_id, cfg=cfg
    )


def file_perplexity(
    model: torch.nn.Module,
    tokenizer,
    inputs: list[str | os.PathLike],
    cfg: PerplexityConfig | None = None,
    *,
    text_field: str = "text",
) -> PerplexityResult:
    """Perplexity of files, directories or globs: a text file is one document, a JSONL line or
    Parquet row one document (read as ``densetrain data prepare`` reads them)."""
    from densetrain.data.sources import ReadStats, expand_inputs, iter_documents

    files = expand_inputs([str(p) for p in inputs])
    stats = ReadStats()
    documents = iter_documents(files, text_field=text_field, stats=stats)
    result = text_perplexity(model, tokenizer, documents, cfg)
    if result.tokens == 0:  # a loss of 0 nats over 0 tokens is no measurement
        raise UserError(f"inputs {[str(p) for p in inputs]} hold no text to score: "
                        f"{result.documents} documents, 0 tokens{stats.skipped_note()}; give "
                        "text, JSONL or Parquet files with some text in them")
    return result


def dataset_perplexity(
    model: torch.nn.Module,
    dataset_dir: str | os.PathLike,
    cfg: PerplexityConfig | None = None,
    *,
    split: str = "val",
    tokenizer=None,
) -> PerplexityResult:
    """Perplexity of one split of a prepared dataset (``densetrain data prepare`` output).

    Documents are read back from the token shards (their trailing EOS dropped) and decoded for
    the byte counts, which is exact for byte-level BPE tokenizers. ``tokenizer`` defaults to the
    copy stored in the dataset; one given must have the dataset's fingerprint.
    """
    from densetrain.data.shards import TokenStore, load_dataset_tokenizer, load_metadata

    cfg = cfg or PerplexityConfig()
    cfg.validate()
    root = Path(dataset_dir)
    meta = load_metadata(root)
    if split not in meta["splits"] or meta["splits"][split]["num_tokens"] == 0:
        present = [k for k, v in meta["splits"].items() if v["num_tokens"]]
        raise UserError(f"dataset {root} has no tokens in split {split!r}; splits: {present}")
    stored = load_dataset_tokenizer(root, meta)  # checked against its meta.json
    if tokenizer is not None and tokenizer.fingerprint != stored.fingerprint:
        raise UserError(
            f"tokenizer {tokenizer.path} differs from the one dataset {root} was prepared with "
            f"(fingerprints {tokenizer.fingerprint[:12]} vs {stored.fingerprint[:12]})"
        )
    tokenizer = tokenizer or stored
    store = TokenStore(root, split, meta)
    eos_id = int(meta["tokenizer"]["eos_id"])

    def documents():
        ends = [*store.doc_starts[1:].tolist(), store.num_tokens]
        for count, (start, end) in enumerate(zip(store.doc_starts.tolist(), ends, strict=True)):
            if cfg.max_documents and count >= cfg.max_documents:
                return
            ids = store.read(start, end - start).tolist()
            if ids and ids[-1] == eos_id:
                ids = ids[:-1]
            yield ids, tokenizer.decode(ids)

    prefix_id = prefix_token_id(tokenizer, cfg.prefix)
    return perplexity_of_token_documents(model, documents(), prefix_id=prefix_id, cfg=cfg)
