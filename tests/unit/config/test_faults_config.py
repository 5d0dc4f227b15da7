"""The ``[faults]`` section: PaLM defaults, bad values named with what is allowed."""

from __future__ import annotations

import pytest

from densetrain.config import load_job_config
from densetrain.config.sections import FaultsConfig, parse_sequence_ranges


def test_defaults_follow_palm_and_validate() -> None:
    cfg = load_job_config(None, []).faults
    # PaLM §5.1: restart ~100 steps before the spike, skip 200-500 batches
    assert cfg.rollback_min_steps == 100 and 200 <= cfg.rollback_skip_batches <= 500
    FaultsConfig().validate()


@pytest.mark.parametrize(("override", "message"), [
    ("--faults.skip_sequences=10:5", r"faults.skip_sequences: '10:5' is not a range"),
    ("--faults.rollback_skip_batches=50", r"faults.rollback_skip_batches must be an integer "
                                          r">= 101"),
    ("--faults.spike_action=restart", r"faults.spike_action must be one of \['stop', "
                                      r"'rollback'\]"),
    ("--faults.spike_threshold=0", r"faults.spike_threshold must be a finite number > 0"),
    ("--faults.spike_min_history=500", r"faults.spike_min_history \(500\) must be <= "),
])
def test_bad_values_are_named(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_job_config(None, [override]).validate(world_size=None)


def test_parse_sequence_ranges() -> None:
    assert parse_sequence_ranges(" 0:8, 16:24 ,", field_name="f") == [(0, 8), (16, 24)]
    assert parse_sequence_ranges("", field_name="f") == []
