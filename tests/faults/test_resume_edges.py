"""Resume edges on real runs and real damage: every checkpoint damaged (refused, never a silent
start over), a bad fault history, a damaged summary of a finished run, a checkpoint directory or
lock file that cannot be one, and ``training.init_from`` sources good and bad."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import faultkit
import pytest

from densetrain.checkpoint.resume import NoVerifiedCheckpointError
from densetrain.errors import DamagedFileError, UserError
from densetrain.train import train
from densetrain.train.fault_record import FaultRecord, check_event

STEPS = ("--training.steps=4",)


def _run_cli(cache: str, run_dir: Path, *extra: str, timeout: float = 300) -> tuple[int, str]:
    """``densetrain train`` on the tiny job in a child process: (exit code, stderr)."""
    child = faultkit.cli(faultkit.overrides(cache, run_dir, *STEPS, *extra))
    _, err = child.communicate(timeout=timeout)
    return child.returncode, err


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("densetrain train: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(fault_cache, tmp_path_factory) -> Path:
    """A finished tiny run of 4 steps with checkpoints at steps 2 and 4 (copied per test)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(faultkit.job(fault_cache, run_dir, *STEPS))
    return run_dir


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_every_checkpoint_damaged_is_refused_not_a_silent_start_over(fault_cache, finished_run,
                                                                    tmp_path) -> None:
    run_dir = _copy(finished_run, tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    for step in (2, 4):
        faultkit.flip_byte(faultkit.largest_shard(checkpoints / f"step-0000000{step}"))
    logs = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "goodput.jsonl")}

    code, err = _run_cli(fault_cache, run_dir, "--training.steps=6")
    assert code == 2
    line = _error_line(err)
    assert "refusing to start this run over from step 0" in line
    assert "step-00000004 (now step-00000004.damaged)" in line
    assert "step-00000002 (now step-00000002.damaged)" in line
    assert "--checkpoint.resume=false" in line and "restore a good copy" in line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002.damaged",
                                                             "step-00000004.damaged"]
    for name, data in logs.items():  # nothing trained, nothing rewritten
        assert (run_dir / name).read_bytes() == data, name

    # A supervisor restarting the job gets the same refusal, not a fresh run from step 0.
    code, err = _run_cli(fault_cache, run_dir, "--training.steps=6")
    assert code == 2
    line = _error_line(err)
    assert "all were set aside as damaged (step-00000002.damaged, step-00000004.damaged)" in line
    for name, data in logs.items():
        assert (run_dir / name).read_bytes() == data, name

    # Starting over on purpose works and keeps the damaged ones for inspection.
    summary = train(faultkit.job(fault_cache, run_dir, *STEPS, "--checkpoint.resume=false"))
    assert summary["steps"] == 4 and summary["resumed_from"] == ""
    assert (checkpoints / "step-00000004").is_dir()
    assert (checkpoints / "step-00000004.damaged").is_dir()


def test_one_good_checkpoint_left_still_resumes(fault_cache, finished_run, tmp_path) -> None:
    run_dir = _copy(finished_run, tmp_path / "run")
    faultkit.flip_byte(faultkit.largest_shard(run_dir / "checkpoints" / "step-00000004"))
    summary = train(faultkit.job(fault_cache, run_dir, "--training.steps=5"))
    assert summary["resumed_from"].endswith("step-00000002")


def test_a_run_killed_before_its_first_checkpoint_restarts_from_the_start(fault_cache,
                                                                         tmp_path) -> None:
    run_dir = tmp_path / "run"
    child = faultkit.cli(faultkit.overrides(fault_cache, run_dir, "--training.steps=100000",
                                            "--checkpoint.interval=100000"))
    deadline = time.monotonic() + 240
    while faultkit.logged_steps(run_dir) < 2:
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert not list((run_dir / "checkpoints").glob("step-*[0-9]"))
    code, err = _run_cli(fault_cache, run_dir, "--training.steps=3")
    assert code == 0, err  # nothing to lose: a plain start, not a refusal
    assert "refusing" not in err


@pytest.mark.parametrize("event, field", [
    ({"event": "rollback", "skip": "abc"}, "needs the field 'spike_step', which is missing"),
    ({"event": "rollback", "spike_step": 10, "to_step": 8, "skip": "abc"}, "field 'skip' is"),
    ({"event": "rollback", "spike_step": "10", "to_step": 8, "skip": [1, 2]},
     "field 'spike_step' is '10'"),
    ({"event": "rollback", "spike_step": 10, "to_step": 12, "skip": [1, 2]},
     "field 'to_step' is 12, not before 'spike_step' 10"),
    ({"event": "rollback", "spike_step": 10, "to_step": 8, "skip": [5, 2]}, "field 'skip' is"),
    ({"event": "rolback", "spike_step": 10}, "field 'event' is 'rolback'"),
    ({"skip": [1, 2]}, "field 'event' is None"),
])
def test_a_bad_fault_event_is_named_with_its_line_and_field(finished_run, tmp_path, event,
                                                            field) -> None:
    run_dir = _copy(finished_run, tmp_path / "run")
    good = {"event": "rollback", "spike_step": 3, "to_step": 2, "skip": [16, 24]}
    (run_dir / "faults.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(event) + "\n")
    pattern = rf"faults.jsonl:2: not a fault event \(.*{re.escape(field)}"
    with pytest.raises(UserError, match=pattern):
        FaultRecord().merge_history(run_dir)


def test_the_audits_bad_fault_history_alone_exits_2(fault_cache, finished_run, tmp_path) -> None:
    run_dir = _copy(finished_run, tmp_path / "run")
    (run_dir / "faults.jsonl").write_text('{"event": "rollback", "skip": "abc"}\n')
    code, err = _run_cli(fault_cache, run_dir, "--training.steps=6")
    assert code == 2  # before: internal error KeyError 'spike_step', exit 1, on every restart
    assert "faults.jsonl:1: not a fault event (a rollback event needs the field 'spike_step'" \
        in _error_line(err)


def test_good_fault_events_pass_the_check() -> None:
    check_event({"event": "rollback", "spike_step": 10, "to_step": 8, "skip": [40, 64],
                 "reason": "spike", "time": 1.0})
    check_event({"event": "sdc", "step": 3, "reason": "replicas differ"})


def test_a_finished_run_with_a_truncated_summary_finishes_naming_it(fault_cache, finished_run,
                                                                   tmp_path) -> None:
    run_dir = _copy(finished_run, tmp_path / "run")
    summary = run_dir / "summary.json"
    summary.write_bytes((finished_run / "summary.json").read_bytes()[:100])
    before = summary.read_bytes()
    code, err = _run_cli(fault_cache, run_dir)
    assert code == 0, err
    assert f"summary {summary} is damaged and left as it is ({summary}:" in err
    assert "already finished" in err and "Traceback" not in err
    assert summary.read_bytes() == before


def test_a_default_checkpoint_directory_that_is_a_file_is_refused_before_training(
        fault_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("x\n")
    code, err = _run_cli(fault_cache, run_dir)
    assert code == 2
    assert f"{run_dir / 'checkpoints'} exists and is not a directory" in _error_line(err)
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained


def test_a_lock_file_that_is_a_directory_is_one_error(fault_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "densetrain.lock").mkdir(parents=True)
    code, err = _run_cli(fault_cache, run_dir)
    assert code == 2
    assert f"{run_dir / 'densetrain.lock'} is a directory" in _error_line(err)


def test_init_from_a_damaged_checkpoint_exits_2_naming_the_field(fault_cache, finished_run,
                                                                tmp_path) -> None:
    source = _copy(finished_run / "checkpoints" / "step-00000004", tmp_path / "c1")
    shard = faultkit.largest_shard(source)
    faultkit.flip_byte(shard)
    code, err = _run_cli(fault_cache, tmp_path / "run", "--checkpoint.enabled=false",
                         f"--training.init_from={source}")
    assert code == 2  # before: exit 1 (caught as a CheckpointError)
    line = _error_line(err)
    assert f"training.init_from='{source}': checkpoint {source} is damaged: {shard.name}" in line
    with pytest.raises(DamagedFileError, match="training.init_from="):
        train(faultkit.job(fault_cache, tmp_path / "run2", "--checkpoint.enabled=false",
                           f"--training.init_from={source}"))


def test_init_from_a_densetrain_model_directory_loads_its_weights(fault_cache, finished_run,
                                                                 tmp_path) -> None:
    from densetrain.eval.loading import load_for_eval
    from densetrain.models.hf import save_model

    model, _ = load_for_eval(finished_run, device="cpu")
    save_model(model, tmp_path / "model")
    first_losses = []
    for name, source in (("a", tmp_path / "model"), ("b", finished_run)):
        run_dir = tmp_path / name
        train(faultkit.job(fault_cache, run_dir, "--training.steps=3",
                           "--checkpoint.enabled=false", f"--training.init_from={source}"))
        first_losses.append(faultkit.curve(run_dir)[0][1])
    assert first_losses[0] == first_losses[1]  # the same weights as the checkpoint itself


@pytest.mark.parametrize("make, expected", [
    (lambda d: d, "is not a model directory (no config.json) and holds no training "
                  "checkpoint; give a densetrain model directory"),
    (lambda d: d / "absent", "does not exist; give a densetrain model directory"),
    (lambda d: (d / "config.json").write_text('{"dim": ') and d, "config.json:1:9: malformed JSON"),
])
def test_init_from_a_bad_source_names_the_field_and_the_kinds(fault_cache, tmp_path, make,
                                                             expected) -> None:
    directory = tmp_path / "src"
    directory.mkdir()
    source = make(directory)
    with pytest.raises(UserError, match="training.init_from=") as refused:
        train(faultkit.job(fault_cache, tmp_path / "run", "--checkpoint.enabled=false",
                           f"--training.init_from={source}"))
    assert expected in str(refused.value)
    assert not isinstance(refused.value, NoVerifiedCheckpointError)
