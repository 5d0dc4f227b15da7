"""The auto checkpoint interval against Young's formula, τ = √(2·δ·M), with hand-computed values,
and the failure count read from a run history."""

from __future__ import annotations

import pytest

from densetrain.checkpoint.interval import (
    LLAMA3_DEVICE_MTBF_HOURS,
    decide,
    failure_history,
    interval_steps,
    last_measured,
    mtbf_hours,
    prior_mtbf_hours,
    young_interval_s,
)
from densetrain.config import load_job_config


def test_young_interval_by_hand() -> None:
    # δ = 30 s, M = 2 h = 7200 s: √(2·30·7200) = √432000 = 657.27 s
    assert young_interval_s(30.0, 7200.0) == pytest.approx(657.267, abs=1e-3)
    # δ = 2 s, M = 100 s: √400 = 20 s
    assert young_interval_s(2.0, 100.0) == 20.0


def test_llama3_prior_by_hand() -> None:
    # 54 days · 24 h · 16384 GPUs / 466 interruptions = 45,565.8 device-hours; on the whole
    # 16k-GPU job that is 54 · 24 / 466 = 2.781 h between interruptions.
    assert LLAMA3_DEVICE_MTBF_HOURS == pytest.approx(45565.8, abs=0.1)
    assert prior_mtbf_hours(LLAMA3_DEVICE_MTBF_HOURS, 16384) == pytest.approx(2.7811, abs=1e-4)
    assert prior_mtbf_hours(1000.0, 8) == 125.0


def test_mtbf_estimate_is_the_prior_then_tends_to_the_observed() -> None:
    assert mtbf_hours(10.0, 0, 0.0) == 10.0
    assert mtbf_hours(10.0, 3, 30.0) == 10.0  # (10 + 30) / 4
    assert mtbf_hours(10.0, 99, 990.0) == 10.0  # (10 + 990) / 100
    assert mtbf_hours(10.0, 4, 5.0) == 3.0  # (10 + 5) / 5


def test_interval_in_steps() -> None:
    assert interval_steps(657.267, 1.5, 1) == 438  # 657.267 / 1.5 = 438.2
    assert interval_steps(20.0, 3.0, 1) == 7  # 6.67 -> 7
    assert interval_steps(20.0, 3.0, 10) == 10  # the floor wins


def test_decide_by_hand() -> None:
    # prior 2 h, 1 failure in 2 h: M = (2 + 2) / 2 = 2 h = 7200 s; δ = 30 s: τ = 657.27 s;
    # at 2 s a step: 328.6 -> 329 steps.
    d = decide(stall_s=30.0, step_s=2.0, prior_hours=2.0, failures=1, exposure_hours=2.0,
               initial=100, minimum=10)
    assert (d.steps, d.mtbf_hours) == (329, 2.0)
    assert d.tau_s == pytest.approx(657.267, abs=1e-3)
    assert "329 steps" in d.describe() and "δ = 30 s" in d.describe()
    before = decide(stall_s=None, step_s=None, prior_hours=2.0, failures=0, exposure_hours=0.0,
                    initial=100, minimum=10)
    assert (before.steps, before.tau_s) == (100, None)
    assert "auto_initial_interval" in before.describe()


def _at(seconds: int) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def test_failure_history_counts_starts_without_a_clean_end() -> None:
    t0 = 1_700_000_000
    events = [
        {"time": _at(t0), "event": "process_start"},                     # crashed (no end)
        {"time": _at(t0 + 3600), "event": "process_start"},              # ends finished
        {"time": _at(t0 + 5400), "event": "process_end", "outcome": "finished"},
        {"time": _at(t0 + 6000), "event": "config_override"},            # ignored
        {"time": _at(t0 + 7200), "event": "process_start"},              # preempted: clean
        {"time": _at(t0 + 9000), "event": "process_end", "outcome": "preempted"},
        {"time": _at(t0 + 10800), "event": "process_start"},             # still running
    ]
    failures, hours = failure_history(events, now=t0 + 12600)
    # exposure: 1 h (crashed, up to the next start) + 0.5 h + 0.5 h + 0.5 h (to now) = 2.5 h
    assert failures == 1
    assert hours == pytest.approx(2.5)
    assert failure_history([], now=t0) == (0, 0.0)


@pytest.mark.parametrize("override, message", [
    ("--checkpoint.interval=0", "checkpoint.interval must be 'auto' or an integer >= 1, got 0"),
    ("--checkpoint.interval=sometimes",
     "checkpoint.interval must be 'auto' or an integer >= 1, got 'sometimes'"),
    ("--checkpoint.auto_min_interval=0", "checkpoint.auto_min_interval must be an integer >= 1"),
    ("--checkpoint.auto_initial_interval=-2",
     "checkpoint.auto_initial_interval must be an integer >= 1"),
    ("--checkpoint.mtbf_prior_device_hours=0",
     "checkpoint.mtbf_prior_device_hours must be a finite number of hours > 0"),
])
def test_config_refuses_out_of_range_values_in_one_line(override, message) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) \
            as err:
        load_job_config(None, [override])
    assert "\n" not in str(err.value)


def test_config_accepts_auto_and_integers() -> None:
    assert load_job_config(None, ["--checkpoint.interval=auto"]).checkpoint.interval == "auto"
    assert load_job_config(None, ["--checkpoint.interval=25"]).checkpoint.interval == 25


def test_last_measured_is_the_predecessors_newest_measurement_at_the_same_world_size() -> None:
    start = {"event": "process_start", "world_size": 4}
    initial = {"event": "checkpoint_interval", "stall_s": None, "step_s": None}
    measured = {"event": "checkpoint_interval", "stall_s": 0.5, "step_s": 0.25}
    newer = {"event": "checkpoint_interval", "stall_s": 0.75, "step_s": 0.5}
    assert last_measured([start, initial, measured, newer, start, initial]) == (0.75, 0.5)
    assert last_measured([start, initial]) is None  # nothing measured yet
    shrunk = {"event": "process_start", "world_size": 2}
    assert last_measured([start, measured, shrunk]) is None  # other ranks, other stall
    torn = {"event": "checkpoint_interval", "stall_s": "x", "step_s": -1}
    assert last_measured([start, measured, torn, start]) == (0.5, 0.25)
