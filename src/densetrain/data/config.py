"""Configuration of the data pipeline: the ``[data]`` section of a job config.

Only simple field types (str, int, float, bool, lists of those) so that the job config system
can compose it from TOML and ``--data.field=value`` overrides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from densetrain.errors import UserError


@dataclass(kw_only=True)
class DataConfig:
    """Where training tokens come from and how they are batched.

    Attributes:
        datasets: prepared dataset directories (from ``densetrain data prepare``); empty means
            the embedded default corpus (the Python standard library of the running interpreter),
            prepared on first use into ``cache_dir``.
        weights: mixture weights, one per dataset; empty means equal weights.
        seq_len: tokens per training sequence (each sample reads ``seq_len + 1`` tokens).
        seed: seed of the global batch order; the order is a pure function of (seed, step).
        document_masking: fill ``Batch.document_ids`` and ``Batch.positions`` so that attention
            can be masked across documents and positions reset at each document (Llama 3).
        max_epochs_warning: warn when a source is repeated more than this many epochs
            (Muennighoff et al. 2023 find up to ~4 epochs of repetition nearly as good as new data).
        use_val: build a validation stream from the datasets' validation split when present.
        tokenizer: optional tokenizer path the run expects; prepared datasets must have been
            tokenized with the same tokenizer (same fingerprint). Empty: use the datasets' own.
        cache_dir: cache of the default corpus and of datasets under a URL (``remote/``);
            empty means ``$DENSETRAIN_CACHE`` or ``~/.cache/densetrain``.
        cache_max_bytes: most bytes of token shards fetched from datasets under a URL
            (``s3://bucket/prefix``) that this process keeps in ``cache_dir``; the least
            recently used are deleted to make room (``data.remote``).
        default_vocab_size: vocabulary size of the tokenizer trained on the default corpus.
        default_max_files: use only the first N standard-library files (sorted); 0 = all.
        default_val_fraction: share of default-corpus documents held out for validation.
    """

    datasets: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    seq_len: int = 256
    seed: int = 1234
    document_masking: bool = False
    max_epochs_warning: float = 4.0
    use_val: bool = True
    tokenizer: str = ""
    cache_dir: str = ""
    cache_max_bytes: int = 20 << 30
    default_vocab_size: int = 8192
    default_max_files: int = 0
    default_val_fraction: float = 0.02

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if self.seq_len < 1:
            raise UserError(f"data.seq_len must be >= 1, got {self.seq_len}")
        from densetrain.storage_url import url_problem  # torch-free, touches no server

        for i, entry in enumerate(self.datasets):
            problem = url_problem(f"data.datasets[{i}]", entry)
            if problem is not None:
                raise UserError(problem)
        if isinstance(self.cache_max_bytes, bool) or not (
                isinstance(self.cache_max_bytes, int) and self.cache_max_bytes > 0):
            raise UserError(f"data.cache_max_bytes must be an integer number of bytes > 0, got "
                            f"{self.cache_max_bytes!r}")
        if self.weights:
            if self.datasets and len(self.weights) != len(self.datasets):
                raise UserError(
                    f"data.weights has {len(self.weights)} entries but data.datasets has "
                    f"{len(self.datasets)}; give one weight per dataset or none (equal weights)"
                )
            if not self.datasets and len(self.weights) != 1:
                raise UserError(
                    "data.weights must be empty or have one entry when data.datasets is empty "
                    "(the default corpus is a single source)"
                )
            validate_weights(self.weights, field_name="data.weights")
        if not (self.max_epochs_warning > 0):
            raise UserError(f"data.max_epochs_warning must be > 0, got {self.max_epochs_warning}")
        if self.default_vocab_size < 260:
            raise UserError(
                "data.default_vocab_size must be >= 260 (256 byte tokens + special tokens), "
                f"got {self.default_vocab_size}"
            )
        if self.default_max_files < 0:
            raise UserError(f"data.default_max_files must be >= 0, got {self.default_max_files}")
        if not (0.0 <= self.default_val_fraction < 1.0):
            raise UserError(
                f"data.default_val_fraction must be in [0, 1), got {self.default_val_fraction}"
            )


def validate_weights(weights: list[float], *, field_name: str = "weights") -> None:
    """Raise ``ValueError`` unless every weight is finite and >= 0 and their sum is > 0."""
    for i, weight in enumerate(weights):
        if not math.isfinite(weight) or weight < 0:
            raise UserError(f"{field_name}[{i}] must be a finite number >= 0, got {weight}")
    if sum(weights) <= 0:
        raise UserError(f"{field_name} must sum to a positive number, got {list(weights)}")
