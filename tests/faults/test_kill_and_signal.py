"""Real signals to real training processes: SIGTERM saves and exits cleanly; kill -9 during a
save and during a step (2 ranks under torchrun, restarted by it) lose nothing but time. Every
case ends with the losses of an undisturbed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import faultkit
import pytest

from densetrain.train.goodput import ledger_totals, read_ledger

LONG = ["--training.steps=20", "--checkpoint.keep_last=2", "--logging.peak_tflops=1"]


@pytest.fixture(scope="module")
def long_reference(fault_cache, tmp_path_factory) -> list[tuple]:
    """The curve of the 20-step job without faults (checkpoint cadence does not change it)."""
    run_dir = tmp_path_factory.mktemp("long-reference") / "run"
    child = faultkit.cli(faultkit.overrides(fault_cache, run_dir, *LONG))
    _, err = child.communicate(timeout=600)
    assert child.returncode == 0, err
    return faultkit.curve(run_dir)


def _wait_for_step(child: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while faultkit.logged_steps(run_dir) < step:
        assert child.poll() is None, child.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_sigterm_saves_and_exits_cleanly_then_resumes_exactly(
        fault_cache, long_reference, tmp_path) -> None:
    run_dir = tmp_path / "run"
    child = faultkit.cli(faultkit.overrides(fault_cache, run_dir, *LONG,
                                            "--checkpoint.interval=1000"))
    _wait_for_step(child, run_dir, 2)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM" in err and "Traceback" not in err
    stopped = faultkit.logged_steps(run_dir)
    assert 2 <= stopped < 20
    assert (run_dir / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").is_file()
    assert not (run_dir / "summary.json").exists()  # the run is not finished
    resumed = faultkit.cli(faultkit.overrides(fault_cache, run_dir, *LONG))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert f"resumed from {run_dir / 'checkpoints'}/step-{stopped:08d}" in err
    assert faultkit.curve(run_dir) == long_reference
    # The checkpoints were written in the background (checkpoint.async_save, the default), and
    # the goodput ledger of the two processes accounts every second of the wall time: the
    # saves (callbacks), the time down between the processes, each step trained exactly once.
    totals, wall = ledger_totals(read_ledger(run_dir))
    assert sum(totals.values()) == pytest.approx(wall, rel=1e-9)
    assert totals["down"] > 0 and totals["callbacks"] > 0 and totals["recomputed"] == 0
    productive = [e["step"] for e in read_ledger(run_dir) if "productive" in e["buckets"]]
    assert sorted(productive) == list(range(1, 21))


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(
        fault_cache, long_reference, tmp_path) -> None:
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    child = faultkit.cli(faultkit.overrides(fault_cache, run_dir, *LONG,
                                            "--checkpoint.interval=1"))
    _wait_for_step(child, run_dir, 4)
    deadline = time.monotonic() + 120
    while not list(checkpoints.glob("*.tmp")):  # a save is being written right now
        assert child.poll() is None and time.monotonic() < deadline
    child.kill()
    child.communicate()
    partial = list(checkpoints.glob("*.tmp"))
    assert partial, "the process finished the save before the kill"
    resumed = faultkit.cli(faultkit.overrides(fault_cache, run_dir, *LONG))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert "resumed from" in err and ".tmp" not in err.split("resumed from")[1].split()[0]
    assert faultkit.curve(run_dir) == long_reference


def _torchrun(fault_cache: str, run_dir: Path, *extra: str, restarts: int = 0):
    # torchrun's agent otherwise shares its rendezvous store with the workers' process group,
    # and a restarted group reads the dead workers' addresses from it (pytorch/pytorch#135712).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", f"--max-restarts={restarts}", "-m", "densetrain", "train",
               *faultkit.overrides(fault_cache, run_dir, *LONG, "--parallel.dp_shard=2",
                                   *extra)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_kill_9_of_a_rank_during_a_step_is_restarted_by_torchrun(fault_cache, tmp_path) -> None:
    straight = _torchrun(fault_cache, tmp_path / "straight")
    _, err = straight.communicate(timeout=900)
    assert straight.returncode == 0, err
    run_dir = tmp_path / "run"
    child = _torchrun(fault_cache, run_dir, "--checkpoint.interval=3", restarts=1)
    _wait_for_step(child, run_dir, 5)
    deadline = time.monotonic() + 300
    while not list((run_dir / "checkpoints").glob("step-*/manifest.json")):
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    workers = [p for agent in faultkit.children(child.pid) for p in [agent]
               if faultkit.env_of(p).get("RANK") == "1"]
    assert workers, "rank 1 not found"
    os.kill(workers[0], signal.SIGKILL)
    _, err = child.communicate(timeout=900)
    assert child.returncode == 0, err  # torchrun restarted the group; it resumed by itself
    assert "resumed from" in err
    assert faultkit.curve(run_dir) == faultkit.curve(tmp_path / "straight")


@pytest.mark.slow
def test_two_rank_fsdp_runs_exit_zero_every_time(fault_cache, tmp_path) -> None:
    for attempt in range(8):
        run_dir = tmp_path / f"run{attempt}"
        child = _torchrun(fault_cache, run_dir, "--training.steps=4")
        _, err = child.communicate(timeout=600)
        assert child.returncode == 0, (attempt, err[-3000:])
        assert (run_dir / "summary.json").is_file()
