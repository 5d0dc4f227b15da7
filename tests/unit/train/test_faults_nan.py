"""Non-finite steps: caps on skipped steps, rollback on a streak, and the whole-state check
before saving (NaN in the optimizer state is never written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densetrain.checkpoint import NonFiniteStateError, list_checkpoints
from densetrain.train import Callback, read_metrics, train
from densetrain.train.callbacks import Checkpointer
from densetrain.train.fault_record import read_history
from densetrain.train.faults import RunFaultError, first_non_finite


class _PoisonOptimizerState(Callback):
    """Writes a NaN into the first moment of one parameter after step ``at``; the model stays
    finite (the poisoned moment has not been used yet)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.model_was_finite: bool | None = None

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at:
            state = next(iter(parts.optimizer.state.values()))
            state["exp_avg"].view(-1)[0] = float("nan")
            model_state = {n: p.detach() for n, p in parts.model.module.named_parameters()}
            self.model_was_finite = first_non_finite(model_state) is None


class _PoisonWeightsOnce(Callback):
    """Writes a NaN into the model after step ``at``, once in the process (every later step is
    non-finite until a rollback restores clean weights)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.done = False

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at and not self.done:
            self.done = True
            with torch.no_grad():
                parts.model.module.layers["0"].attn.wq.weight[0, 0] = float("nan")


def test_nan_in_optimizer_state_is_never_saved(make_job) -> None:
    job = make_job("--training.steps=4", "--checkpoint.enabled=false", "--eval.interval=0",
                   "--eval.sample_tokens=0", "--logging.plot=false")
    poison = _PoisonOptimizerState(at=3)
    saver = Checkpointer(interval=3, save_final=False)  # runs after the poison
    with pytest.raises(NonFiniteStateError,
                       match=r"refusing to save step 3: tensor optim\.") as err:
        train(job, callbacks=[poison, saver])
    assert "exp_avg" in str(err.value) and "rank 0" in str(err.value)
    assert poison.model_was_finite  # a check of the model alone would have saved it
    checkpoint_dir = Path(job.logging.run_dir) / "checkpoints"
    assert list_checkpoints(checkpoint_dir) == []
    assert not list(checkpoint_dir.glob("*.tmp")) if checkpoint_dir.exists() else True


def test_first_non_finite_names_nested_tensors() -> None:
    tree = {"a": {"w": torch.ones(3)}, "b": [torch.zeros(2), {"m": torch.tensor([1.0, 2.0])}],
            "n": 3, "s": "text", "i": torch.arange(3)}
    assert first_non_finite(tree) is None
    tree["b"][1]["m"][1] = float("inf")
    assert first_non_finite(tree) == "b.1.m"


def test_consecutive_skip_cap_stops_naming_the_step(make_job) -> None:
    job = make_job("--training.steps=12", "--training.nan_policy=skip",
                   "--faults.max_consecutive_skips=2", "--faults.nan_cap_action=stop",
                   "--checkpoint.enabled=false", "--eval.interval=0", "--eval.sample_tokens=0")
    with pytest.raises(RunFaultError, match=r"3 non-finite steps in a row up to step 6"):
        train(job, callbacks=[_PoisonWeightsOnce(at=3)])
    records = read_metrics(job.logging.run_dir)
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 1, 2]  # step 6 raised first


def test_total_skip_cap_stops(make_job) -> None:
    job = make_job("--training.steps=12", "--training.nan_policy=skip",
                   "--faults.max_skipped_steps=1", "--faults.max_consecutive_skips=5",
                   "--checkpoint.enabled=false", "--eval.interval=0", "--eval.sample_tokens=0")
    with pytest.raises(RunFaultError, match=r"step 5: 2 steps .* faults.max_skipped_steps=1"):
        train(job, callbacks=[_PoisonWeightsOnce(at=3)])


@pytest.mark.slow
def test_non_finite_streak_rolls_back_and_the_run_finishes(make_job) -> None:
    job = make_job("--training.steps=10", "--training.nan_policy=skip",
                   "--faults.max_consecutive_skips=0", "--faults.rollback_min_steps=1",
                   "--faults.rollback_skip_batches=2", "--checkpoint.interval=2",
                   "--checkpoint.keep_last=0", "--eval.interval=0", "--eval.sample_tokens=0")
    summary = train(job, callbacks=[_PoisonWeightsOnce(at=5)])
    (event,) = read_history(job.logging.run_dir)
    # step 6 was the first non-finite step; the newest checkpoint at least 1 step before it
    assert (event["spike_step"], event["to_step"]) == (6, 4)
    assert event["skip"] == [4 * 8, 6 * 8]  # two batches of 8 sequences after step 4
    records = read_metrics(job.logging.run_dir)
    assert [r["step"] for r in records] == list(range(1, 11))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert summary["steps"] == 10
    steps = [s for s, _ in list_checkpoints(Path(job.logging.run_dir) / "checkpoints")]
    assert steps == [2, 4, 6, 8, 10]  # step 6 saved again after the rollback, finite
