"""Loss spikes (PaLM §5.1): detected, rolled back in the same process to an earlier checkpoint,
the batches after it skipped; later losses equal a run that skipped them from the start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densetrain.checkpoint import list_checkpoints
from densetrain.train import Callback, read_metrics, train
from densetrain.train.fault_record import read_history
from densetrain.train.faults import RunFaultError
from densetrain.train.spikes import SpikeDetector

SPIKE_JOB = ("--training.steps=12", "--checkpoint.interval=4", "--checkpoint.keep_last=0",
             "--eval.interval=0", "--eval.sample_tokens=0", "--logging.plot=false",
             "--faults.spike_warmup_steps=6", "--faults.spike_min_history=4",
             "--faults.spike_window=8", "--faults.rollback_min_steps=2",
             "--faults.rollback_skip_batches=3")


class _ScaleOutput(Callback):
    """Multiplies the output projection by ``factor`` after step ``at`` (the next step's loss
    spikes), ``times`` times in the process."""

    def __init__(self, at: int, factor: float = 30.0, times: int = 1) -> None:
        self.at, self.factor, self.left = at, factor, times

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at and self.left > 0:
            self.left -= 1
            with torch.no_grad():
                parts.model.module.output.weight.mul_(self.factor)


class _InterruptAfterRollback(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at and parts.fault_record.rollbacks:
            raise KeyboardInterrupt(f"interrupted after step {self.at}")


def _losses(run_dir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def test_detector_flags_a_jump_not_a_falling_loss() -> None:
    detector = SpikeDetector(window=8, threshold=6.0, min_deviation=0.01, warmup_steps=0,
                             min_history=4)
    falling = [6.0 - 0.1 * i for i in range(20)]
    assert all(detector.observe(i, v) is None for i, v in enumerate(falling))
    spike = detector.observe(20, 9.0)
    assert spike is not None and spike.step == 20 and spike.sigmas > 6
    assert detector.observe(21, 4.2) is None  # the spike did not join the window
    detector.forget_after(15)
    assert max(s for s, _ in detector.history) == 15


def test_spike_is_rolled_back_and_skipped_like_a_run_that_skipped_from_the_start(make_job):
    job = make_job(*SPIKE_JOB, run="spiked")
    train(job, callbacks=[_ScaleOutput(at=9)])
    (event,) = read_history(job.logging.run_dir)
    assert (event["spike_step"], event["to_step"]) == (10, 8)
    assert event["loss"] > event["median"] + 6 * event["deviation"]
    start, end = event["skip"]
    assert (start, end) == (8 * 8, 11 * 8)  # three batches of 8 sequences after step 8

    reference = make_job(*SPIKE_JOB, f"--faults.skip_sequences={start}:{end}", run="reference")
    train(reference)
    spiked, clean = _losses(job.logging.run_dir), _losses(reference.logging.run_dir)
    assert sorted(spiked) == list(range(1, 13))
    assert spiked == clean  # bit-equal: same checkpoint state, same batches
    assert not read_history(reference.logging.run_dir)
    steps = [s for s, _ in list_checkpoints(Path(job.logging.run_dir) / "checkpoints")]
    assert steps == [4, 8, 12]


@pytest.mark.slow
def test_rollback_cap_ends_the_run(make_job):
    job = make_job(*SPIKE_JOB, "--faults.max_rollbacks=1")
    with pytest.raises(RunFaultError, match=r"already rolled back 1 time\(s\) for spikes at "
                                            r"steps \[10\]"):
        train(job, callbacks=[_ScaleOutput(at=9, times=2)])
    assert len(read_history(job.logging.run_dir)) == 1


@pytest.mark.slow
def test_spike_without_an_early_enough_checkpoint_stops(make_job):
    job = make_job(*SPIKE_JOB, "--faults.rollback_min_steps=20",
                   "--faults.rollback_skip_batches=21")
    with pytest.raises(RunFaultError, match=r"loss spike at step 10.*no complete checkpoint"):
        train(job, callbacks=[_ScaleOutput(at=9)])


@pytest.mark.slow
def test_resume_after_a_rollback_skips_the_same_batches(make_job):
    """Killed after the rollback but before a new checkpoint: the checkpoint on disk predates
    the skip, and the history file carries it to the resumed process."""
    job = make_job(*SPIKE_JOB, run="resumed")
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[_ScaleOutput(at=9), _InterruptAfterRollback(at=10)])
    assert [s for s, _ in list_checkpoints(Path(job.logging.run_dir) / "checkpoints")] == [4, 8]
    train(job)
    start, end = read_history(job.logging.run_dir)[0]["skip"]
    reference = make_job(*SPIKE_JOB, f"--faults.skip_sequences={start}:{end}", run="reference")
    train(reference)
    assert _losses(job.logging.run_dir) == _losses(reference.logging.run_dir)
