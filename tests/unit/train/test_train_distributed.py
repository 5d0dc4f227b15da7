"""The trainer on two gloo ranks (FSDP2 over dp_shard=2): same losses as one process, and its
checkpoint resumes on one process (a different layout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from densetrain.testing import run_distributed
from densetrain.train import read_metrics, train


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    return train(load_job_config(None, overrides))


def test_two_rank_fsdp_matches_one_process_and_resumes_on_one(make_job, tiny_overrides,
                                                              tmp_path) -> None:
    common = ["--training.steps=4", "--eval.interval=0", "--eval.sample_tokens=0",
              "--checkpoint.interval=4", "--logging.plot=false"]
    single = make_job(*common, run="single")
    train(single)
    two_rank_dir = tmp_path / "two"
    overrides = tiny_overrides + common + [
        f"--data.cache_dir={single.data.cache_dir}", f"--logging.run_dir={two_rank_dir}",
        "--parallel.dp_shard=2",
    ]
    results = run_distributed(_train_on_rank, 2, overrides, timeout=240)
    assert results[0]["final_loss"] == results[1]["final_loss"]
    one = [r["loss"] for r in read_metrics(single.logging.run_dir)]
    two = [r["loss"] for r in read_metrics(two_rank_dir)]
    assert two == pytest.approx(one, rel=1e-4, abs=1e-5)
    # The sharded checkpoint continues on one process (resharding through DCP).
    resumed = make_job("--training.steps=6", "--eval.interval=0", "--eval.sample_tokens=0",
                       "--logging.plot=false", f"--checkpoint.dir={two_rank_dir / 'checkpoints'}",
                       run="resumed")
    summary = train(resumed)
    assert summary["resumed_from"].endswith("step-00000004")
    assert [r["step"] for r in read_metrics(resumed.logging.run_dir)] == [5, 6]
    assert Path(summary["checkpoint"]).name == "step-00000006"
