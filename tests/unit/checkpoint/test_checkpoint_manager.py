"""Checkpoint save/load: round trip, atomic visibility, retention, shape errors, NaN guard, gloo."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from densetrain.checkpoint import (
    CheckpointError,
    CheckpointShapeError,
    ModelState,
    NonFiniteStateError,
    RNGState,
    TrainerCounters,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from densetrain.optim.interface import StandardOptimizer
from densetrain.testing import run_distributed


class _Stream:
    """A minimal Stateful standing in for the data stream."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _net(width: int = 8) -> torch.nn.Module:
    layers = [torch.nn.Linear(4, width), torch.nn.GELU(), torch.nn.Linear(width, 2)]
    return torch.nn.Sequential(*layers)


def _train_steps(model, opt, steps: int, *, average_grads: bool = False) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(3, 4)
        loss = model(x).square().mean()
        loss.backward()
        if average_grads:  # replicated data parallel, as DDP does
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _tree(model, opt, stream, counters):
    return {
        "model": ModelState(model),
        "optim": StandardOptimizer(model, opt),
        "data": stream,
        "trainer": counters,
        "rng": RNGState(),
    }


def test_round_trip_restores_everything_and_continues_identically(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, opt, 3)
    stream, counters = _Stream(), TrainerCounters(step=3, tokens=99)
    stream.position = 7
    random.seed(5)
    np.random.seed(6)
    path = save_checkpoint(tmp_path, 3, _tree(model, opt, stream, counters), config_toml="a = 1\n")
    reference = _train_steps(model, opt, 4)
    ref_py, ref_np = random.random(), np.random.rand()

    model2 = _net()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    stream2, counters2 = _Stream(), TrainerCounters()
    torch.manual_seed(123)
    load_checkpoint(path, _tree(model2, opt2, stream2, counters2))
    assert (stream2.position, counters2.step, counters2.tokens) == (7, 3, 99)
    assert _train_steps(model2, opt2, 4) == reference  # bit-exact: weights, Adam moments, RNG
    assert (random.random(), np.random.rand()) == (ref_py, ref_np)
    assert read_checkpoint_config(path) == "a = 1\n"


def test_retention_keeps_last_k(tmp_path: Path) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (10, 20, 30, 40):
        tree = _tree(model, opt, _Stream(), TrainerCounters(step=step))
        save_checkpoint(tmp_path, step, tree, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]


def test_interrupted_save_leaves_previous_loadable(tmp_path: Path, monkeypatch) -> None:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, opt, 1)
    save_checkpoint(tmp_path, 1, _tree(model, opt, _Stream(), TrainerCounters(step=1)))
    saved_weight = model[0].weight.detach().clone()
    _train_steps(model, opt, 1)

    real_write = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        real_write(self, plan, planner).wait()  # shards land on disk, then the disk "fills"
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_fail)
    with pytest.raises(CheckpointError, match="step 2"):
        save_checkpoint(tmp_path, 2, _tree(model, opt, _Stream(), TrainerCounters(step=2)))
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    # A partial directory left by a killed process is never picked either.
    (tmp_path / "step-00000003.tmp").mkdir()
    (tmp_path / "step-00000004").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    fresh = _net()
    load_checkpoint(
        latest_checkpoint(tmp_path),
        _tree(fresh, torch.optim.AdamW(fresh.parameters()), _Stream(), TrainerCounters()),
    )
    assert torch.equal(fresh[0].weight, saved_weight)


def test_other_model_shape_fails_naming_the_tensor(tmp_path: Path) -> None:
    model = _net(8)
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, 1, _tree(model, opt, _Stream(), TrainerCounters()))
    other = _net(16)
    before = other[0].weight.detach().clone()
    tree = _tree(other, torch.optim.AdamW(other.parameters()), _Stream(), TrainerCounters())
    with pytest.raises(CheckpointShapeError, match=r"'model\.0\.weight'.*\(8, 4\).*\(16, 4\)"):
        load_checkpoint(path, tree)
    assert torch.equal(other[0].weight, before)


def test_non_finite_model_is_never_saved(tmp_path: Path) -> None:
    model = _net()
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteStateError, match=r"step 5.*model\.2\.bias"):
        save_checkpoint(tmp_path, 5, _tree(model, opt, _Stream(), TrainerCounters()))
    assert latest_checkpoint(tmp_path) is None


def _two_rank_round_trip(rank: int, world_size: int, directory: str) -> list[float]:
    torch.manual_seed(0)  # same weights on both ranks (replicated data parallel)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(10 + rank)  # each rank draws its own data
    _train_steps(model, opt, 2, average_grads=True)
    stream = _Stream()
    stream.position = 11
    path = save_checkpoint(
        directory, 2, _tree(model, opt, stream, TrainerCounters(step=2)), config_toml="x = 2\n"
    )
    expected = _train_steps(model, opt, 2, average_grads=True)
    fresh = _net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    stream2 = _Stream()
    load_checkpoint(path, _tree(fresh, fresh_opt, stream2, TrainerCounters()))
    assert stream2.position == 11
    resumed = _train_steps(fresh, fresh_opt, 2, average_grads=True)
    assert resumed == expected, (rank, resumed, expected)
    return resumed


def test_two_gloo_ranks_save_and_load(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_round_trip, 2, str(tmp_path / "ckpt"), timeout=120)
    assert results[0] != results[1]  # per-rank RNG streams were each restored
    assert latest_checkpoint(tmp_path / "ckpt").name == "step-00000002"
    assert read_checkpoint_config(latest_checkpoint(tmp_path / "ckpt")) == "x = 2\n"
