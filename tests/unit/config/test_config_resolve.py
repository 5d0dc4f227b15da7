"""Resolution is separate from validation: `resolve_job` returns a new job with the derived
fields filled and leaves its input as it was; `JobConfig.validate` modifies nothing.

The expected values are worked by hand from the rules (a sequence is ``data.seq_len`` = 256
tokens; the default global batch is 16 sequences = 4,096 tokens a step).
"""

from __future__ import annotations

import dataclasses

import pytest

from densetrain.config import (
    apply_override,
    default_job_config,
    load_job_config,
    parse_overrides,
)
from densetrain.config.rules import resolve_job


def _unresolved(*overrides: str):
    """The embedded default with ``overrides`` applied, neither validated nor resolved."""
    job = default_job_config()
    for key, value, text in parse_overrides(list(overrides)):
        apply_override(job, key, value, text)
    return job


@pytest.mark.parametrize("overrides, world_size, dp_size, expected", [
    # 8,192 tokens / 256 = 32 sequences; one rank: one micro-batch of 32; tokens kept
    (["--training.global_batch_tokens=8192"], 1, None,
     {"global_batch_size": 32, "global_batch_tokens": 8192, "micro_batch_size": 32,
      "warmup_steps": 30, "warmup_tokens": 0}),
    # 8,192 warmup tokens / 4,096 a step = 2 steps; warmup_tokens then 0
    (["--schedule.warmup_steps=0", "--schedule.warmup_tokens=8192"], 1, None,
     {"global_batch_size": 16, "global_batch_tokens": 0, "micro_batch_size": 16,
      "warmup_steps": 2, "warmup_tokens": 0}),
    # two replicas: 8 sequences a rank; 40,960 tokens / 4,096 = 10 steps
    (["--parallel.dp_replicate=2", "--schedule.warmup_steps=0",
      "--schedule.warmup_tokens=40960"], 2, None,
     {"global_batch_size": 16, "global_batch_tokens": 0, "micro_batch_size": 8,
      "warmup_steps": 10, "warmup_tokens": 0}),
    # pp=2 on 2 ranks: dp 1, the rank's 16 sequences in 2 pipeline microbatches of 8
    (["--parallel.pp=2"], 2, None,
     {"global_batch_size": 16, "global_batch_tokens": 0, "micro_batch_size": 8,
      "warmup_steps": 30, "warmup_tokens": 0}),
    # dp_size given: 4 data-parallel ranks of 4 sequences
    (["--training.global_batch_tokens=4096"], 4, 4,
     {"global_batch_size": 16, "global_batch_tokens": 4096, "micro_batch_size": 4,
      "warmup_steps": 30, "warmup_tokens": 0}),
    # away from the cluster (no world size): the micro-batch size stays "derive" (0)
    (["--training.global_batch_tokens=8192", "--schedule.warmup_steps=0",
      "--schedule.warmup_tokens=8192"], None, None,
     {"global_batch_size": 32, "global_batch_tokens": 8192, "micro_batch_size": 0,
      "warmup_steps": 1, "warmup_tokens": 0}),
])
def test_resolve_job_fills_the_derived_fields_and_leaves_its_input(overrides, world_size,
                                                                   dp_size, expected):
    job = _unresolved(*overrides)
    before = dataclasses.asdict(job)
    resolved = resolve_job(job, world_size=world_size, dp_size=dp_size)
    assert dataclasses.asdict(job) == before  # the input is never modified
    assert resolved is not job
    assert resolved.training is not job.training and resolved.schedule is not job.schedule
    got = {
        "global_batch_size": resolved.training.global_batch_size,
        "global_batch_tokens": resolved.training.global_batch_tokens,
        "micro_batch_size": resolved.training.micro_batch_size,
        "warmup_steps": resolved.schedule.warmup_steps,
        "warmup_tokens": resolved.schedule.warmup_tokens,
    }
    assert got == expected
    # The method, and resolving twice, give the same job; validation modifies nothing.
    assert job.resolved(world_size=world_size, dp_size=dp_size) == resolved
    assert resolve_job(resolved, world_size=world_size, dp_size=dp_size) == resolved
    job.validate(world_size=world_size, dp_size=dp_size)
    resolved.validate(world_size=world_size, dp_size=dp_size)
    assert dataclasses.asdict(job) == before
    # Validating and resolving in one pass gives the same job, and modifies nothing either.
    assert job.checked(world_size=world_size, dp_size=dp_size) == resolved
    assert dataclasses.asdict(job) == before


def test_the_loader_returns_the_resolved_copy():
    overrides = ["--schedule.warmup_steps=0", "--schedule.warmup_tokens=8192",
                 "--training.global_batch_tokens=8192"]
    for world_size in (None, 1, 2):
        loaded = load_job_config(None, overrides, world_size=world_size)
        assert loaded == resolve_job(_unresolved(*overrides), world_size=world_size)


def test_resolve_job_raises_what_validate_raises_for_a_derivation():
    job = _unresolved("--training.global_batch_tokens=1000")
    with pytest.raises(ValueError, match="global_batch_tokens=1000 is not divisible") as told:
        resolve_job(job)
    with pytest.raises(ValueError) as validated:
        job.validate()
    assert str(told.value) == str(validated.value)
    with pytest.raises(ValueError) as checked:
        job.checked()
    assert str(checked.value) == str(validated.value)
