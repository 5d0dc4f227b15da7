"""A tiny job on a small slice of the default corpus, prepared once per test session."""

from __future__ import annotations

import pytest
import torch

TINY_OVERRIDES = [
    "--model.dim=64",
    "--model.embed_dim=64",  # presets resolve derived widths at construction: restate them
    "--model.head_dim=16",
    "--model.num_layers=2",
    "--model.num_heads=4",
    "--model.num_kv_heads=2",
    "--model.ffn_dim=128",
    "--data.seq_len=32",
    "--data.default_max_files=40",
    "--data.default_vocab_size=512",
    "--data.default_val_fraction=0.2",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=4",
    "--training.steps=20",
    "--schedule.warmup_steps=2",
    "--optim.lr=3e-3",
    "--eval.interval=10",
    "--eval.num_batches=2",
    "--eval.sample_tokens=8",
    "--checkpoint.interval=10",
    "--logging.log_interval=1",
    "--logging.progress=false",
    "--logging.tensorboard=false",
]


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """A default-corpus cache shared by every trainer test of the session."""
    return str(tmp_path_factory.mktemp("corpus-cache"))


@pytest.fixture
def tiny_overrides() -> list[str]:
    """The overrides that make the default job tiny."""
    return list(TINY_OVERRIDES)


@pytest.fixture
def make_job(corpus_cache, tmp_path):
    """``make_job(*overrides, run="run")`` → a validated tiny `JobConfig` writing under tmp."""
    from densetrain.config import load_job_config

    def build(*overrides: str, run: str = "run"):
        base = TINY_OVERRIDES + [
            f"--data.cache_dir={corpus_cache}",
            f"--logging.run_dir={tmp_path / run}",
        ]
        return load_job_config(None, base + list(overrides))

    torch.set_num_threads(2)
    return build
