"""A background checkpoint save that runs out of space on a real small tmpfs: reported at the
next step, never visible as a checkpoint, and the run stops or goes on as
``checkpoint.on_save_error`` says; a resume starts from the last verified checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from densetrain.checkpoint import checkpoint_name, list_checkpoints, verify_checkpoint
from densetrain.cli.main import main
from densetrain.config.sections import CheckpointConfig
from densetrain.train import Callback, read_metrics, train

JOB = ("--training.steps=8", "--checkpoint.interval=2", "--checkpoint.async_save=true",
       "--eval.interval=0", "--eval.sample_tokens=0", "--logging.plot=false")


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(bytes)`` → a freshly mounted tmpfs of that size (unmounted after)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}  # the last record of a step


def _undisturbed(make_job) -> tuple[dict[int, float], int]:
    """The losses of the same job saved on an ample disk, and one checkpoint's size."""
    job = make_job(*JOB, "--checkpoint.keep_last=0", run="undisturbed")
    train(job)
    first = Path(job.logging.run_dir) / "checkpoints" / checkpoint_name(2)
    size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
    return _losses(job.logging.run_dir), size


def _only_complete_checkpoints(disk: Path, steps: list[int]) -> None:
    assert [s for s, _ in list_checkpoints(disk)] == steps
    assert sorted(p.name for p in disk.iterdir()) == [checkpoint_name(s) for s in steps]
    assert all(verify_checkpoint(disk / checkpoint_name(s)) == [] for s in steps)


def test_disk_full_stops_the_run_in_one_line_and_resume_takes_the_last_good_one(
        make_job, small_disk, tiny_overrides, corpus_cache, tmp_path, capfd) -> None:
    reference, size = _undisturbed(make_job)
    disk = small_disk(size * 3 // 2)  # the first checkpoint fits, a second one does not
    run_dir = tmp_path / "full"
    argv = ["train", *tiny_overrides, f"--data.cache_dir={corpus_cache}",
            f"--logging.run_dir={run_dir}", *JOB, f"--checkpoint.dir={disk}",
            "--checkpoint.keep_last=0"]
    capfd.readouterr()
    assert main(argv) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line.lower()]
    assert len(errors) == 1, err
    (line,) = errors
    assert line.startswith("densetrain train: error: saving checkpoint step 4 ")
    assert str(disk) in line and "no space left on device" in line
    assert "checkpoint.on_save_error='stop'" in line
    _only_complete_checkpoints(disk, [2])  # nothing of step 4 left, step 2 untouched
    stopped_at = max(_losses(run_dir))
    assert 4 < stopped_at <= 6  # the next step or, at the latest, the next save

    resumed = make_job(*JOB, f"--checkpoint.dir={disk}", "--checkpoint.interval=100",
                       "--checkpoint.save_final=false", run="full")
    summary = train(resumed)
    assert Path(summary["resumed_from"]).name == checkpoint_name(2)
    after = _losses(run_dir)
    assert {s: after[s] for s in range(3, 9)} == {s: reference[s] for s in range(3, 9)}


class _FillDisk(Callback):
    """Fills ``disk`` after step ``at`` so the next save fails; empties it once that failed
    save has been cleaned up (its ``.tmp`` is gone), so the save after it has room."""

    def __init__(self, disk: Path, at: int, leave: int) -> None:
        self.disk, self.at, self.leave = disk, at, leave
        self.filler = disk.parent / "filler-is-elsewhere"
        self.filled_at: int | None = None

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at:
            # the previous step's background save may still be writing: let it finish (it
            # becomes visible when complete) so that only the next save meets the full disk
            done = self.disk / checkpoint_name(self.at - 1)
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.filler = self.disk / "filler"
            free = shutil.disk_usage(self.disk).free
            with open(self.filler, "wb") as f:
                f.write(b"\0" * max(0, free - self.leave))
            self.filled_at = progress.step
        elif self.filled_at is not None and progress.step == self.at + 2:
            failed = self.disk / (checkpoint_name(self.at + 1) + ".tmp")
            deadline = time.monotonic() + 60
            while failed.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.filler.unlink()
            self.filled_at = None


def test_disk_full_with_continue_warns_once_and_the_next_save_succeeds(
        make_job, small_disk, capfd) -> None:
    reference, size = _undisturbed(make_job)
    disk = small_disk(size * 5)
    job = make_job(*JOB, f"--checkpoint.dir={disk}", "--checkpoint.keep_last=0",
                   "--checkpoint.on_save_error=continue", run="continue")
    capfd.readouterr()
    summary = train(job, callbacks=[_FillDisk(disk, at=3, leave=size // 2)])
    err = capfd.readouterr().err
    assert summary["steps"] == 8
    assert "Traceback" not in err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, err
    assert "saving checkpoint step 4 " in warnings[0] and str(disk) in warnings[0]
    assert "no space left on device" in warnings[0] and "continue" in warnings[0]
    _only_complete_checkpoints(disk, [2, 6, 8])  # step 4 failed, invisible; 6 retried fine
    assert _losses(job.logging.run_dir) == reference


@pytest.mark.parametrize("value", ["ignore", "", "Stop"])
def test_a_bad_on_save_error_is_one_line_naming_the_field(value) -> None:
    with pytest.raises(ValueError) as caught:
        CheckpointConfig(on_save_error=value).validate()
    message = str(caught.value)
    assert message.startswith("checkpoint.on_save_error must be one of ['stop', 'continue']")
    assert "\n" not in message
