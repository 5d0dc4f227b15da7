"""Fixtures of the fault-injection suite: a shared corpus cache and an undisturbed reference."""

from __future__ import annotations

import faultkit
import pytest
import torch


@pytest.fixture(scope="session")
def fault_cache(tmp_path_factory) -> str:
    """A default-corpus cache shared by every fault test."""
    return str(tmp_path_factory.mktemp("fault-cache"))


@pytest.fixture(scope="session")
def reference(fault_cache, tmp_path_factory) -> list[tuple[int, float, float]]:
    """The loss curve of the tiny job run once without any fault."""
    from densetrain.train import train

    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(faultkit.job(fault_cache, run_dir))
    return faultkit.curve(run_dir)


@pytest.fixture(autouse=True)
def one_thread():
    """Every run of the suite on one intra-op thread (subprocesses too), so curves compare
    bit for bit; the previous setting is restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
