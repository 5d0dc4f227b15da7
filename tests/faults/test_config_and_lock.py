"""A config change on resume and a second run in the same directory, on real runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import faultkit
import pytest

from densetrain.checkpoint.lock import LOCK_FILE, RunLockedError
from densetrain.checkpoint.resume import ConfigChangeError
from densetrain.train import train


def test_model_and_data_order_changes_are_refused_naming_each_field(fault_cache,
                                                                   tmp_path) -> None:
    run_dir = tmp_path / "run"
    train(faultkit.job(fault_cache, run_dir, "--training.steps=3"))
    changed = faultkit.job(fault_cache, run_dir, "--training.steps=6", "--model.num_layers=1",
                           "--model.rope_theta=500000.0", "--data.seed=7")
    with pytest.raises(ConfigChangeError) as refused:
        train(changed)
    message = str(refused.value)
    for field in ("model.num_layers: 2 -> 1", "model.rope_theta: 10000.0 -> 500000.0",
                  "data.seed: 1234 -> 7"):
        assert field in message
    assert "training.steps" not in message  # steps may change on resume
    assert "--checkpoint.allow_config_change=true" in message
    assert faultkit.history(run_dir) == []


def test_steps_intervals_and_logging_may_change_and_match_the_reference(
        fault_cache, reference, tmp_path) -> None:
    run_dir = tmp_path / "run"
    train(faultkit.job(fault_cache, run_dir, "--training.steps=6", "--checkpoint.interval=4",
                       "--checkpoint.save_final=false"))
    (run_dir / "checkpoints" / "step-00000004").rename(run_dir / "keep")
    # Back to step 4 with other intervals: the continuation equals the undisturbed run.
    for path in (run_dir / "checkpoints").iterdir():
        path.rename(run_dir / f"old-{path.name}")
    (run_dir / "keep").rename(run_dir / "checkpoints" / "step-00000004")
    summary = train(faultkit.job(fault_cache, run_dir, "--checkpoint.interval=5",
                                 "--logging.log_interval=1", "--eval.interval=0"))
    assert summary["resumed_from"].endswith("step-00000004")
    assert faultkit.curve(run_dir) == reference


def test_allowed_config_change_is_logged_in_the_history(fault_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    train(faultkit.job(fault_cache, run_dir, "--training.steps=3"))
    summary = train(faultkit.job(fault_cache, run_dir, "--training.seed=5",
                                 "--checkpoint.allow_config_change=true"))
    assert summary["resumed_from"].endswith("step-00000003")
    (event,) = [e for e in faultkit.history(run_dir) if e["event"] == "config_override"]
    assert event["changes"] == [{"field": "training.seed", "old": 0, "new": 5}]


def test_second_run_in_the_same_directory_exits_naming_the_holder(fault_cache,
                                                                  tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = faultkit.cli(faultkit.overrides(fault_cache, run_dir, "--training.steps=100000"))
    try:
        lock = run_dir / LOCK_FILE
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        with pytest.raises(RunLockedError, match=rf"pid {first.pid} on host"):
            train(faultkit.job(fault_cache, run_dir))
        second = faultkit.cli(faultkit.overrides(fault_cache, run_dir))
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1 and f"pid {first.pid}" in err
        assert "Traceback" not in err
    finally:
        first.kill()
        first.communicate()


def test_stale_lock_of_a_dead_process_is_taken_over(fault_cache, tmp_path, capfd) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    (run_dir / LOCK_FILE).write_text(json.dumps(
        {"host": "elsewhere", "pid": pid, "start_time": "2026-01-01T00:00:00Z"}))
    train(faultkit.job(fault_cache, run_dir, "--training.steps=3"))
    assert f"left by pid {pid} on host 'elsewhere'" in capfd.readouterr().err
    assert not (run_dir / LOCK_FILE).exists()  # released at the end of the run
