"""A tiny training run (default corpus slice, a few steps), trained once per test session."""

from __future__ import annotations

import pytest
import torch

TINY_RUN = [
    "--model.dim=64", "--model.embed_dim=64", "--model.head_dim=16", "--model.num_layers=2",
    "--model.num_heads=4", "--model.num_kv_heads=2", "--model.ffn_dim=128",
    "--data.seq_len=32", "--data.default_max_files=40", "--data.default_vocab_size=512",
    "--data.default_val_fraction=0.2", "--training.global_batch_size=8",
    "--training.micro_batch_size=4", "--training.steps=3", "--schedule.warmup_steps=1",
    "--optim.lr=3e-3", "--eval.interval=0", "--eval.sample_tokens=0",
    "--checkpoint.interval=3", "--logging.progress=false", "--logging.tensorboard=false",
    "--logging.plot=false",
]


def tiny_run_overrides(cache_dir: str, run_dir: str, *extra: str) -> list[str]:
    """Overrides of the tiny run writing into ``run_dir`` with the corpus in ``cache_dir``."""
    return TINY_RUN + [f"--data.cache_dir={cache_dir}", f"--logging.run_dir={run_dir}",
                       *extra]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """``(run_dir, cache_dir)`` of a finished tiny one-process run."""
    from densetrain.config import load_job_config
    from densetrain.train import train

    torch.set_num_threads(2)
    cache = tmp_path_factory.mktemp("corpus-cache")
    run = tmp_path_factory.mktemp("runs") / "single"
    train(load_job_config(None, tiny_run_overrides(str(cache), str(run))))
    return run, cache


@pytest.fixture
def run_overrides():
    """``run_overrides(cache_dir, run_dir, *extra)`` → the tiny run's overrides."""
    return tiny_run_overrides
