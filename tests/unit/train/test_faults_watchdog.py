"""Hang watchdog: a really stalled rank (two gloo ranks, one sleeps) is named with its step and
stack long before the collective timeout; the window's limit follows the recent median."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from densetrain.testing import DistributedTestError, run_distributed
from densetrain.train.watchdog import HANG_EXIT_CODE, HangWatchdog

STALLED_RANK, STALL_AFTER_STEP = 1, 7


def _train_stalling(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config
    from densetrain.train import Callback, train

    class StallOneRank(Callback):
        def on_step_end(self, parts, progress, report) -> None:
            if parts.rank == STALLED_RANK and progress.step == STALL_AFTER_STEP:
                time.sleep(120)  # a stuck rank: the other one waits in step 8's collectives

    return train(load_job_config(None, overrides), callbacks=[StallOneRank()])


@pytest.mark.slow
def test_stalled_rank_is_named_with_step_and_stack(corpus_cache, tiny_overrides,
                                                    tmp_path) -> None:
    run_dir = tmp_path / "stalled"
    overrides = tiny_overrides + [
        f"--data.cache_dir={corpus_cache}", f"--logging.run_dir={run_dir}",
        "--training.steps=12", "--eval.interval=0", "--eval.sample_tokens=0",
        "--checkpoint.enabled=false", "--logging.plot=false", "--parallel.dp_shard=2",
        "--faults.hang_min_seconds=3", "--faults.hang_first_steps_seconds=60",
        "--parallel.collective_timeout_s=100",
    ]
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=f"exit code {HANG_EXIT_CODE}"):
        run_distributed(_train_stalling, 2, overrides, timeout=200)
    assert time.monotonic() - start < 90  # far before the 100 s collective timeout
    log = (Path(run_dir) / f"watchdog-rank{STALLED_RANK}.log").read_text()
    assert f"rank {STALLED_RANK} has spent" in log
    assert f"in step {STALL_AFTER_STEP} (callbacks)" in log
    assert "on_step_end" in log and "test_faults_watchdog.py" in log  # the sleeping frame


def test_limit_follows_the_median_and_a_fast_loop_is_left_alone(tmp_path) -> None:
    watchdog = HangWatchdog(rank=0, run_dir=tmp_path, factor=10.0, min_seconds=0.5,
                            first_step_seconds=30.0, min_history=3)
    try:
        assert watchdog.limit() == 30.0
        for step in range(1, 6):
            watchdog.begin(step)
            time.sleep(0.01)
            watchdog.end()
        assert watchdog.limit() == 0.5  # 10 × ~0.01 s is below the floor
        watchdog.durations.extend([0.2] * 10)
        assert watchdog.limit() == pytest.approx(2.0)
    finally:
        watchdog.close()
    assert not (tmp_path / "watchdog-rank0.log").exists()
