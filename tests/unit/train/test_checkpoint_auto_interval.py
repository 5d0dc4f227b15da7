"""``checkpoint.interval=auto`` on a real tiny run: the saves fall at the interval Young's formula
gives from the stall and step time the run measured, and failures in the run history shorten it.
The prior MTBF is shrunk to seconds so the interval is a few steps."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from densetrain.checkpoint import list_checkpoints
from densetrain.train import train

PRIOR_H = 0.01  # 36 s on one rank
JOB = ("--training.steps=14", "--checkpoint.interval=auto", "--checkpoint.keep_last=0",
       "--checkpoint.auto_initial_interval=2", "--checkpoint.auto_min_interval=1",
       f"--checkpoint.mtbf_prior_device_hours={PRIOR_H}", "--checkpoint.save_final=false",
       "--eval.interval=0", "--eval.sample_tokens=0", "--logging.plot=false")


def _events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "run_history.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _young_steps(event: dict) -> int:
    """The independent formula: τ = √(2·δ·M), M = (prior + T) / (1 + n), in whole steps."""
    mtbf_s = (PRIOR_H + event["exposure_hours"]) / (1 + event["failures"]) * 3600
    return max(1, round(math.sqrt(2 * event["stall_s"] * mtbf_s) / event["step_s"]))


def _check_saves_follow_the_decisions(run_dir: Path) -> list[dict]:
    decisions = _events(run_dir, "checkpoint_interval")
    assert decisions[0]["step"] == 0 and decisions[0]["steps"] == 2  # nothing measured yet
    expected, step, interval = [], 0, 2
    by_step = {d["step"]: d for d in decisions}
    for measured in decisions[1:]:
        assert measured["steps"] == _young_steps(measured)
    while step + interval <= 14:  # replay the cadence: each save may change the interval
        step += interval
        expected.append(step)
        interval = by_step.get(step, {}).get("steps", interval)
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == expected
    return decisions


def test_auto_interval_follows_young_and_shrinks_with_failures(make_job, tmp_path,
                                                               capfd) -> None:
    calm = make_job(*JOB, run="calm")
    summary = train(calm)
    calm_dir = Path(calm.logging.run_dir)
    decisions = _check_saves_follow_the_decisions(calm_dir)
    final = summary["checkpoint_interval"]
    assert final["failures"] == 0 and final["stall_s"] > 0 and final["step_s"] > 0
    assert "checkpoint.interval=auto: saving every" in capfd.readouterr().err
    assert len(_events(calm_dir, "process_start")) == 1
    assert _events(calm_dir, "process_end")[0]["outcome"] == "finished"
    assert decisions[-1] == {"event": "checkpoint_interval", "time": decisions[-1]["time"],
                             "step": decisions[-1]["step"], **final}

    # 20 processes that died a second apart: M = (0.01 h + ~20 s) / 21, ~1/10 of the prior.
    stormy_dir = tmp_path / "stormy"
    stormy_dir.mkdir()
    now = int(time.time())
    with open(stormy_dir / "run_history.jsonl", "w") as f:
        for k in range(20, 0, -1):
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - k))
            f.write(json.dumps({"time": stamp, "event": "process_start"}) + "\n")
    stormy = train(make_job(*JOB, run="stormy"))["checkpoint_interval"]
    _check_saves_follow_the_decisions(stormy_dir)
    assert stormy["failures"] == 20
    assert stormy["mtbf_hours"] < final["mtbf_hours"] / 5
    # with the same measured stall and step time, the calm history would give a longer one
    calm_mtbf_s = PRIOR_H * 3600
    calm_steps = round(math.sqrt(2 * stormy["stall_s"] * calm_mtbf_s) / stormy["step_s"])
    assert stormy["steps"] < calm_steps


def test_a_restarted_process_starts_at_the_interval_its_predecessor_measured(make_job) -> None:
    first = make_job(*JOB, run="restarted")
    measured = train(first)["checkpoint_interval"]
    run_dir = Path(first.logging.run_dir)
    train(make_job(*JOB[1:], "--training.steps=18", run="restarted"))  # resumes, trains on
    events = [json.loads(line) for line in
              (run_dir / "run_history.jsonl").read_text().splitlines()]
    second_start = max(i for i, e in enumerate(events) if e["event"] == "process_start")
    opening = next(e for e in events[second_start:] if e["event"] == "checkpoint_interval")
    assert opening["carried"] is True
    assert (opening["stall_s"], opening["step_s"]) == (measured["stall_s"], measured["step_s"])
    assert opening["steps"] == _young_steps(opening)  # Young's at once, not the initial 2
