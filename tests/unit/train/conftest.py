"""A tiny job on a small slice of the default corpus, prepared once per test session."""

from __future__ import annotations

import pytest
import torch

from densetrain.testing import TINY_OVERRIDES


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
        base = list(TINY_OVERRIDES) + [
            f"--data.cache_dir={corpus_cache}",
            f"--logging.run_dir={tmp_path / run}",
        ]
        return load_job_config(None, base + list(overrides))

    torch.set_num_threads(2)
    return build
