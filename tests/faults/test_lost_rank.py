"""A rank really lost mid-run (SIGKILL, SIGSTOP) is named by the survivor, from the ranks'
heartbeats in the job's store: one line with its rank, host, pid and last step, and the exit
status of a lost rank (`EXIT_RANK_FAILURE`), or the hang watchdog's message naming it.

The two ranks are started as a multi-node launcher starts them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``; rank 0 serves the store), not under one torchrun agent, which
would stop the survivor as soon as the other rank dies."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import faultkit

from densetrain.cli.main import EXIT_RANK_FAILURE
from densetrain.train.watchdog import HANG_EXIT_CODE

LONG_RUN = ["--training.steps=100000", "--checkpoint.enabled=false", "--parallel.dp_shard=2",
            "--parallel.collective_timeout_s=120"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(fault_cache: str, run_dir: Path, *extra: str) -> list[subprocess.Popen]:
    port = _free_port()
    ranks = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "densetrain", "train",
             *faultkit.overrides(fault_cache, run_dir, *LONG_RUN, *extra)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return ranks


def _wait_for_step(ranks: list[subprocess.Popen], run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while faultkit.logged_steps(run_dir) < step:
        for child in ranks:
            assert child.poll() is None, child.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _named_step(message: str, rank: int, pid: int) -> int:
    pattern = (rf"rank {rank} of 2 \(host {re.escape(socket.gethostname())}, pid {pid}\) is "
               rf"lost: last seen at step (\d+)(, no heartbeat for \d+\.\d s|; its process "
               rf"(is gone|exited|is stopped \(killed, so that the restart need not wait for "
               rf"it\)))")
    found = re.search(pattern, message)
    assert found, message
    return int(found.group(1))


def test_a_killed_rank_is_named_in_one_line_with_its_own_exit_status(
        fault_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    ranks = _launch(fault_cache, run_dir)
    try:
        _wait_for_step(ranks, run_dir, 3)
        ranks[1].send_signal(signal.SIGKILL)
        killed_after = faultkit.logged_steps(run_dir)
        _, err = ranks[0].communicate(timeout=60)
    finally:
        for child in ranks:
            child.kill()
            child.communicate()
    assert ranks[0].returncode == EXIT_RANK_FAILURE, err[-3000:]
    # After the last step's log line, one line: the backend's own text is not on stderr.
    lines = [line for line in err.splitlines() if line.strip()]
    last_step_line = max(i for i, line in enumerate(lines) if line.startswith("step "))
    assert len(lines[last_step_line + 1:]) == 1, err[-3000:]
    line = lines[-1]
    assert sum(line.startswith("densetrain train: error:") for line in lines) == 1
    assert not any("Traceback" in line or "gloo" in line.lower() for line in lines), err[-3000:]
    assert line.startswith("densetrain train: error: rank 0 of 2 failed at step "), line
    assert "internal error" not in line and "Traceback" not in line
    assert "gloo" not in line.lower() and "Connection" not in line
    # Its heartbeat publishes a new step within heartbeat.MIN_GAP_S: a few of these short steps.
    named = _named_step(line, 1, ranks[1].pid)
    assert max(1, killed_after - 5) <= named <= faultkit.logged_steps(run_dir) + 1, line


def test_a_stopped_rank_is_named_by_the_watchdog(fault_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    ranks = _launch(fault_cache, run_dir, "--faults.hang_min_seconds=3",
                    "--faults.hang_first_steps_seconds=60")
    try:
        _wait_for_step(ranks, run_dir, 8)  # more than the watchdog's 5 timed iterations
        ranks[1].send_signal(signal.SIGSTOP)
        stopped_after = faultkit.logged_steps(run_dir)
        start = time.monotonic()
        _, err = ranks[0].communicate(timeout=60)
        waited = time.monotonic() - start
        # the survivor killed the stopped rank (a stopped process cannot act on the
        # launcher's SIGTERM): nothing else would end it
        fenced = ranks[1].wait(timeout=10)
    finally:
        for child in ranks:
            child.kill()
            child.communicate()
    assert ranks[0].returncode == HANG_EXIT_CODE, err[-3000:]
    message = err.split("Every thread's Python stack follows")[0]
    assert "hang watchdog: rank 0 has spent" in message, err[-3000:]
    assert "heartbeats: rank 1 of 2" in message
    named = _named_step(message, 1, ranks[1].pid)  # within heartbeat.MIN_GAP_S of its last
    assert max(1, stopped_after - 5) <= named <= stopped_after + 1, message[-500:]
    assert waited < 40  # far before the 120 s collective timeout
    assert fenced == -signal.SIGKILL
    assert "is stopped (killed, so that the restart need not wait for it)" in message
