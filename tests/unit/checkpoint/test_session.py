"""`CheckpointSession`: save (sync and async), resume, rollback and the schema migrations,
checked against the plain checkpoint functions (`save_checkpoint`, `load_checkpoint`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from densetrain.checkpoint import (
    CheckpointSession,
    ModelState,
    NonFiniteStateError,
    RNGState,
    TrainerCounters,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from densetrain.checkpoint.manager import checkpoint_keys
from densetrain.optim.interface import StandardOptimizer
from densetrain.testing import run_distributed
from densetrain.train.fault_record import FaultRecord

CONFIG = "[training]\nsteps = 10\n"
SCHEMA = ["model", "optim", "lr_schedule", "batch_schedule", "data", "rng", "trainer", "faults"]


class _Stream:
    """A Stateful stand-in for the data stream (``content`` as the real one records it)."""

    def __init__(self, *, with_content: bool = True) -> None:
        self.consumed = 0
        self.with_content = with_content
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        state = {"consumed_sequences": self.consumed}
        if self.with_content:
            state["content"] = "abc"
        return state

    def load_state_dict(self, state: dict) -> None:
        self.loaded = dict(state)
        self.consumed = int(state["consumed_sequences"])


class _BatchSchedule:
    def __init__(self) -> None:
        self.size = 4

    def state_dict(self) -> dict:
        return {"size": self.size}

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])


class _Run:
    """The Stateful parts of a tiny run and its session."""

    def __init__(self, root: Path, *, keep_last: int = 0, async_save: bool = False,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                          torch.nn.Linear(8, 2))
        self.torch_opt = torch.optim.AdamW(self.module.parameters(), lr=1e-2)
        self.optimizer = StandardOptimizer(self.module, self.torch_opt)
        self.lr = torch.optim.lr_scheduler.LambdaLR(self.torch_opt, lambda s: 1.0 / (1 + s))
        self.batches, self.data = _BatchSchedule(), _Stream()
        self.progress, self.faults = TrainerCounters(), FaultRecord()
        self.loads = 0
        self.session = CheckpointSession(
            model=ModelState(self.module), optimizer=self.optimizer, lr_schedule=self.lr,
            batch_schedule=self.batches, data=self.data, progress=self.progress,
            faults=self.faults, directory=root / "ckpt", run_dir=root,
            config_toml=CONFIG, keep_last=keep_last, async_save=async_save,
            after_load=self._after_load)

    def _after_load(self) -> None:
        self.loads += 1

    def train(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.module(torch.randn(3, 4)).square().mean()
            loss.backward()
            self.torch_opt.step()
            self.torch_opt.zero_grad()
            self.lr.step()
            self.progress.step += 1
            self.progress.tokens += 12
            self.data.consumed += 3
            self.batches.size += 1

    def snapshot(self) -> dict:
        return {
            "weights": {k: v.clone() for k, v in self.module.state_dict().items()},
            "moments": [s["exp_avg"].clone() for s in self.torch_opt.state.values()],
            "lr": self.lr.state_dict()["last_epoch"],
            "counters": (self.progress.step, self.progress.tokens, self.data.consumed,
                         self.batches.size),
        }


def _same(a: dict, b: dict) -> bool:
    return (a["weights"].keys() == b["weights"].keys()
            and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
            and len(a["moments"]) == len(b["moments"])
            and all(torch.equal(x, y) for x, y in zip(a["moments"], b["moments"], strict=True))
            and a["lr"] == b["lr"] and a["counters"] == b["counters"])


def test_tree_is_the_checkpoint_schema(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    tree = run.session.tree()
    assert list(tree) == SCHEMA
    assert tree["trainer"] is run.progress and tree["faults"] is run.faults
    assert isinstance(tree["rng"], RNGState)


def test_saved_state_resumes_equal_and_matches_load_checkpoint(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    run.train(3)
    run.faults.add_skip(5, 9)
    saved = run.snapshot()
    run.session.save(3)
    assert run.session.last_path == tmp_path / "ckpt" / "step-00000003"
    run.train(2)  # moves on: a resume must bring back step 3, not this

    fresh = _Run(tmp_path, seed=1)
    assert fresh.session.resume(world_size=1) == str(tmp_path / "ckpt" / "step-00000003")
    assert _same(fresh.snapshot(), saved)
    assert fresh.faults.skip_ranges == [(5, 9)] and fresh.loads == 1
    assert fresh.session.resumed_from == tmp_path / "ckpt" / "step-00000003"

    # the reference: the plain loader into a tree built by hand gives the same state
    other = _Run(tmp_path, seed=2)
    load_checkpoint(run.session.last_path, {
        "model": ModelState(other.module), "optim": other.optimizer, "lr_schedule": other.lr,
        "batch_schedule": other.batches, "data": other.data, "rng": RNGState(),
        "trainer": other.progress, "faults": other.faults})
    assert _same(other.snapshot(), saved)


def test_resume_without_checkpoints_starts_fresh(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    assert run.session.resume() == ""
    assert run.progress.step == 0 and run.loads == 0 and run.session.resumed_from is None


def test_resume_on_more_ranks_is_recorded(tmp_path: Path, capsys) -> None:
    run = _Run(tmp_path)
    run.train(1)
    run.session.save(1)
    fresh = _Run(tmp_path, seed=1)
    fresh.session.resume(world_size=2)
    assert "world size changed" in capsys.readouterr().err
    lines = (tmp_path / "run_history.jsonl").read_text().splitlines()
    event = json.loads(lines[-1])
    assert (event["event"], event["from"], event["to"], event["step"]) == (
        "world_size_changed", 1, 2, 1)


def test_old_checkpoint_without_faults_or_content_is_migrated(tmp_path: Path) -> None:
    """A checkpoint written before the fault record and the data's content existed, by the
    plain saver: its tree has neither; the session loads it all the same."""
    old = _Run(tmp_path)
    old.train(2)
    old.data.with_content = False
    tree = old.session.tree()
    del tree["faults"]
    save_checkpoint(tmp_path / "ckpt", 2, tree, config_toml=CONFIG)
    path = tmp_path / "ckpt" / "step-00000002"
    assert not any(k.startswith("faults.") for k in checkpoint_keys(path))

    fresh = _Run(tmp_path, seed=1)
    fresh.faults.add_skip(1, 2)  # not in the checkpoint: kept as it is
    as_in = fresh.session.tree(as_in=path)
    assert "faults" not in as_in and "content" not in as_in["data"].state_dict()
    assert fresh.session.resume(world_size=1) == str(path)
    assert fresh.data.loaded == {"consumed_sequences": 6}
    assert fresh.faults.skip_ranges == [(1, 2)]
    assert _same(fresh.snapshot(), {**old.snapshot()})


def test_async_saves_prune_to_keep_last(tmp_path: Path) -> None:
    run = _Run(tmp_path, keep_last=2, async_save=True)
    run.session.open()
    for step in range(1, 5):
        run.train(1)
        run.session.save(step)
        assert run.session.has_pending
        run.session.wait()
        assert not run.session.has_pending and not run.session.settled
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [3, 4]
    saved = run.snapshot()
    run.session.save(4, wait=True)  # a step just saved is not saved again
    run.session.close()
    fresh = _Run(tmp_path, seed=1)
    fresh.session.resume(world_size=1)
    assert _same(fresh.snapshot(), saved)


def test_non_finite_optimizer_state_is_never_saved(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    run.train(1)
    next(iter(run.torch_opt.state.values()))["exp_avg"].view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteStateError, match=r"refusing to save step 1: tensor optim\."):
        run.session.save(1)
    assert list_checkpoints(tmp_path / "ckpt") == []


def test_rollback_deletes_later_checkpoints_and_restores_that_step(tmp_path: Path) -> None:
    run = _Run(tmp_path, async_save=True)
    snapshots = {}
    for step in (2, 4, 6):
        run.train(2)
        snapshots[step] = run.snapshot()
        run.session.save(step)
    run.train(1)
    run.faults.add_rollback(7, 0)  # happened after every checkpoint: must survive the load
    assert run.session.newest_at_most(5)[0] == 4
    to_step, path = run.session.rollback(5)  # the save of step 6 in flight is settled first
    assert (to_step, path) == (4, tmp_path / "ckpt" / "step-00000004")
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2, 4]
    assert _same(run.snapshot(), snapshots[4]) and run.loads == 1
    assert run.faults.rollbacks and run.faults.rollbacks[-1]["spike_step"] == 7
    assert run.session.rollback(1) is None and run.loads == 1  # none <= 1: nothing changes
    assert run.session.newest_at_most(1) is None
    run.session.close()


def test_load_model_weights_takes_the_newest_verified_checkpoint(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    run.train(1)
    run.session.save(1)
    run.train(1)
    run.session.save(2)
    model = _Run(tmp_path, seed=3).module
    assert load_model_weights(tmp_path / "ckpt", model) == tmp_path / "ckpt" / "step-00000002"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 run.module.state_dict().values(), strict=True))
    (tmp_path / "empty").mkdir()
    assert load_model_weights(tmp_path / "empty", model) is None


def _two_rank_rollback(rank: int, world_size: int, root: str) -> list[float]:
    run = _Run(Path(root), async_save=True)
    run.session.open()
    saved = {}
    for step in (1, 2, 3):
        run.train(1)
        saved[step] = [p.detach().clone() for p in run.module.parameters()]
        run.session.save(step)
    assert run.session.rollback(2) == (2, Path(root) / "ckpt" / "step-00000002")
    steps = [s for s, _ in list_checkpoints(Path(root) / "ckpt")]
    assert steps == [1, 2], (rank, steps)
    restored = list(run.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(restored, saved[2], strict=True)), rank
    assert run.progress.step == 2
    run.session.close()
    return [float(p.sum()) for p in restored]


def test_two_gloo_ranks_roll_back(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_rollback, 2, str(tmp_path), timeout=180)
    assert len(results) == 2
    assert os.path.isdir(tmp_path / "ckpt" / "step-00000002")
