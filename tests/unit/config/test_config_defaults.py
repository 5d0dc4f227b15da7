"""Defaults that follow the run: the embedded default's warmup scales with a shorter run, and
``training.micro_batch_size = 0`` becomes the rank's batch (split over pipeline microbatches)."""

from __future__ import annotations

import pytest

from densetrain.config import load_job_config


@pytest.mark.parametrize("steps, warmup", [(300, 30), (1000, 30), (20, 2), (9, 0)])
def test_default_warmup_follows_a_shorter_run(steps, warmup):
    job = load_job_config(None, [f"--training.steps={steps}"])
    assert job.schedule.warmup_steps == warmup


def test_a_stated_warmup_is_taken_as_written():
    assert load_job_config(None, ["--training.steps=20", "--schedule.warmup_steps=5"]
                           ).schedule.warmup_steps == 5
    job = load_job_config(None, ["--training.steps=100", "--schedule.warmup_tokens=8192"])
    assert job.schedule.warmup_steps == 2  # 8192 tokens of 16 × 256 per step
    with pytest.raises(ValueError, match=r"e.g. --schedule.warmup_steps=1"):
        load_job_config(None, ["--training.steps=10", "--schedule.warmup_steps=10"])


@pytest.mark.parametrize("layout, world_size, micro", [
    ([], 1, 16),
    (["--parallel.dp_replicate=2"], 2, 8),
    (["--parallel.dp_shard=2"], 2, 8),
    (["--parallel.dp_shard=-1"], 4, 4),
    (["--parallel.tp=2"], 2, 16),
    (["--parallel.cp=2"], 2, 16),
    (["--parallel.pp=2"], 2, 8),
    (["--parallel.pp=2", "--parallel.pp_microbatches=4"], 2, 4),
])
def test_derived_micro_batch_fits_every_layout(layout, world_size, micro):
    job = load_job_config(None, layout)
    assert job.training.micro_batch_size == 0  # away from the cluster: still "derive"
    job.validate(world_size=world_size)
    assert job.training.micro_batch_size == 0  # validate modifies nothing
    assert job.resolved(world_size=world_size).training.micro_batch_size == micro


def test_a_stated_micro_batch_is_kept_and_checked():
    job = load_job_config(None, ["--training.micro_batch_size=4"])
    job.validate(world_size=2, dp_size=2)
    assert job.training.micro_batch_size == 4
    with pytest.raises(ValueError, match="micro_batch_size x data-parallel size = 16 x 2"):
        load_job_config(None, ["--training.micro_batch_size=16"]).validate(world_size=2,
                                                                            dp_size=2)
