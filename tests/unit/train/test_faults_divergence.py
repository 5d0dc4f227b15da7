"""Divergence before the spike detector arms: a loss far above the initial one stops the run
(no checkpoint to roll back to) with one message; a normal run is untouched."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from densetrain.checkpoint import list_checkpoints
from densetrain.config.sections import FaultsConfig
from densetrain.train import read_metrics, train
from densetrain.train.faults import RunFaultError

JOB = ("--training.steps=8", "--eval.interval=0", "--eval.sample_tokens=0",
       "--logging.plot=false", "--checkpoint.interval=100", "--checkpoint.save_final=false",
       "--faults.spike_warmup_steps=100")


def test_a_huge_learning_rate_stops_the_run_at_the_step_it_diverged(make_job) -> None:
    job = make_job(*JOB, "--optim.lr=0.5", "--optim.grad_clip=0", run="diverged")
    with pytest.raises(RunFaultError) as caught:
        train(job)
    message = str(caught.value)
    assert "\n" not in message
    # the guard runs before the step is logged: the logged steps are the ones that passed
    losses = {r["step"]: r["loss"] for r in read_metrics(job.logging.run_dir)}
    margin = job.faults.divergence_margin
    initial = losses[1]
    assert all(loss - initial <= margin for loss in losses.values())
    bad = max(losses) + 1
    found = re.search(r"diverged at step (\d+): loss (\S+), .* initial loss (\S+) ", message)
    assert found, message
    assert int(found.group(1)) == bad <= job.faults.spike_warmup_steps
    loss, named_initial = float(found.group(2)), float(found.group(3))
    assert named_initial == pytest.approx(initial, abs=1e-4)
    assert not math.isfinite(loss) or loss - initial > margin
    assert "optim.lr" in message and "warmup" in message
    assert not list_checkpoints(Path(job.logging.run_dir) / "checkpoints")


def test_off_when_the_margin_is_zero_and_a_normal_run_is_untouched(make_job) -> None:
    normal = make_job(*JOB, run="normal")
    summary = train(normal)
    assert summary["steps"] == 8
    off = make_job(*JOB, "--faults.divergence_margin=0", run="off")
    train(off)
    losses = [r["loss"] for r in read_metrics(normal.logging.run_dir)]
    assert losses == [r["loss"] for r in read_metrics(off.logging.run_dir)]
    stopped = make_job(*JOB, "--optim.lr=0.5", "--optim.grad_clip=0",
                       "--faults.divergence_margin=0", "--training.nan_policy=skip",
                       run="unchecked")
    assert train(stopped)["steps"] == 8  # with the check off, nothing stops the run


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "5"])
def test_a_bad_margin_is_one_line_naming_the_field(value) -> None:
    with pytest.raises(ValueError) as caught:
        FaultsConfig(divergence_margin=value).validate()
    assert str(caught.value).startswith("faults.divergence_margin must be")
    assert "\n" not in str(caught.value)
