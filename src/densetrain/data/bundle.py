"""``build_data``: a ``DataConfig`` -> train/validation ``BatchStream`` and ``Tokenizer``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from densetrain.data.config import DataConfig
from densetrain.data.default_corpus import default_corpus_dir, ensure_default_corpus
from densetrain.data.remote import RemoteDatasetError, resolve_dataset
from densetrain.data.shards import TokenStore, load_dataset_tokenizer, load_metadata
from densetrain.data.stream import BatchStream
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.errors import UserError


@dataclass(kw_only=True)
class DataBundle:
    """What a training job gets from the data layer."""

    train: BatchStream
    val: BatchStream | None
    tokenizer: Tokenizer


def _dataset_tokenizer(paths: list[Path], metas: list[dict], expected: str) -> Tokenizer:
    """The datasets' shared tokenizer; errors when datasets or the run's tokenizer differ."""
    first = metas[0]["tokenizer"]["fingerprint"]
    for path, meta in zip(paths, metas, strict=True):
        if meta["tokenizer"]["fingerprint"] != first:
            raise UserError(
                f"dataset {path} was prepared with a different tokenizer than {paths[0]} "
                f"(fingerprints {meta['tokenizer']['fingerprint'][:12]} vs {first[:12]}); "
                "prepare every dataset of a mixture with the same tokenizer"
            )
    tokenizer = load_dataset_tokenizer(paths[0], metas[0])
    if expected:
        wanted = load_tokenizer(expected)
        if wanted.fingerprint != first:
            raise UserError(
                f"data.tokenizer {expected} differs from the tokenizer the datasets were "
                f"prepared with (fingerprint {wanted.fingerprint[:12]} vs {first[:12]}); "
                "prepare the data again with this tokenizer"
            )
        tokenizer = wanted
    return tokenizer


def _corpus_settings(cfg: DataConfig) -> dict:
    """The default corpus's settings of ``cfg`` (where it is cached, how it is prepared)."""
    return dict(cache_dir=cfg.cache_dir, vocab_size=cfg.default_vocab_size,
                max_files=cfg.default_max_files, val_fraction=cfg.default_val_fraction)


def job_tokenizer(cfg: DataConfig, *, source: str | Path) -> Tokenizer:
    """The tokenizer `build_data` gives a job of ``cfg``, found without preparing anything:
    for a checkpoint's or run's stored config (``source``, named in the errors).

    While the job's datasets (or its default corpus) are there, their tokenizer fingerprints are
    checked as a training run checks them, so a ``data.tokenizer`` changed since is refused.
    Without them, ``data.tokenizer`` (when set) is the job's tokenizer; otherwise a tokenizer
    that is no longer there is an error naming the paths and ``--tokenizer``.
    """
    paths, missing = [], []
    for entry in cfg.datasets:
        try:
            paths.append(resolve_dataset(entry, cfg).root)  # a URL: its metadata fetched
        except RemoteDatasetError:  # gone from the store, or the store out of reach
            missing.append(entry)
    paths = paths or ([] if missing else [default_corpus_dir(**_corpus_settings(cfg))])
    missing += [p for p in paths if not p.is_dir()]
    named = Path(cfg.tokenizer) if cfg.tokenizer else None
    if named is not None and not named.exists() or named is None and missing:
        gone = [named] if named is not None else missing
        raise UserError(
            f"the tokenizer of {source} cannot be found: its config names "
            f"{', '.join(map(str, gone))}, which does not exist (moved, or a cache that was "
            "cleared); pass --tokenizer PATH (the tokenizer.json the run trained with)"
        )
    if missing:
        return load_tokenizer(named)
    return _dataset_tokenizer(paths, [load_metadata(p) for p in paths], cfg.tokenizer)


def _stream(cfg: DataConfig, stores, weights, names, dp_rank: int, dp_size: int) -> BatchStream:
    return BatchStream(
        stores,
        weights,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        document_masking=cfg.document_masking,
        max_epochs_warning=cfg.max_epochs_warning,
        names=names,
    )


def build_data(cfg: DataConfig, *, dp_rank: int = 0, dp_size: int = 1) -> DataBundle:
    """Open (or, for the default corpus, first prepare) the datasets and build the streams."""
    cfg.validate()
    sources = [resolve_dataset(p, cfg) for p in cfg.datasets]  # a URL: `data.remote`
    paths = [s.root for s in sources] or [ensure_default_corpus(**_corpus_settings(cfg))]
    remotes = [s.remote for s in sources] or [None]
    metas = [load_metadata(p) for p in paths]
    tokenizer = _dataset_tokenizer(paths, metas, cfg.tokenizer)
    weights = list(cfg.weights) if cfg.weights else [1.0] * len(paths)
    names = [s.name for s in sources] or [str(p) for p in paths]

    def store(i: int, split: str) -> TokenStore:
        remote = remotes[i]
        return TokenStore(paths[i], split, metas[i],
                          remote=remote.split(split) if remote is not None else None)

    train = _stream(
        cfg,
        [store(i, "train") for i in range(len(paths))],
        weights,
        names,
        dp_rank,
        dp_size,
    )
    val = None
    if cfg.use_val:
        with_val = [
            i
            for i, m in enumerate(metas)
            if m["splits"].get("val", {}).get("num_tokens", 0) > cfg.seq_len
        ]
        if with_val and sum(weights[i] for i in with_val) > 0:
            val = _stream(
                cfg,
                [store(i, "val") for i in with_val],
                [weights[i] for i in with_val],
                [names[i] for i in with_val],
                dp_rank,
                dp_size,
            )
    return DataBundle(train=train, val=val, tokenizer=tokenizer)
