"""Samples and validation during training (``logging.sample_interval``, ``eval.interval``): they
leave the training itself untouched, and a pipelined run on two gloo ranks (the sample gathers
both stages' weights) generates the same greedy text as one process at the same step."""

from __future__ import annotations

import pytest

from densetrain.testing import run_distributed
from densetrain.train import read_metrics, train

COMMON = ["--training.steps=4", "--eval.interval=2", "--eval.sample_tokens=8",
          "--checkpoint.enabled=false", "--logging.plot=false"]


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    return train(load_job_config(None, overrides))


def test_samples_during_training_match_across_layouts_and_change_no_step(
        make_job, tiny_overrides, tmp_path, capfd) -> None:
    sampled = make_job(*COMMON, "--logging.sample_interval=2", run="sampled")
    summary = train(sampled)
    err = capfd.readouterr().err
    assert [s["step"] for s in summary["samples"]] == [2]  # step 4's is the final sample
    assert err.count("sample (greedy) | 'def ' ->") == 2
    assert summary["samples"][0]["text"] and summary["sample"]
    plain = make_job(*COMMON, run="plain")
    train(plain)
    with_samples = read_metrics(sampled.logging.run_dir)
    without = read_metrics(plain.logging.run_dir)
    assert [r["loss"] for r in with_samples] == [r["loss"] for r in without]  # bit for bit
    assert [r.get("val_loss") for r in with_samples] == [r.get("val_loss") for r in without]
    assert [r["step"] for r in with_samples if "val_loss" in r] == [2, 4]

    pp_dir = tmp_path / "pp"
    overrides = tiny_overrides + COMMON + [
        f"--data.cache_dir={sampled.data.cache_dir}", f"--logging.run_dir={pp_dir}",
        "--logging.sample_interval=2", "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
        "--parallel.dp_shard=1",
    ]
    results = run_distributed(_train_on_rank, 2, overrides, timeout=240)
    assert results[0]["samples"] == summary["samples"]  # same greedy text at step 2
    assert results[0]["sample"] == summary["sample"]
    assert results[1]["samples"] == [{"step": 2, "text": ""}]  # rank 1 only takes part
    two = read_metrics(pp_dir)
    assert [r["step"] for r in two if "val_loss" in r] == [2, 4]
    assert [r["val_loss"] for r in two if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in with_samples if "val_loss" in r], rel=1e-4, abs=1e-5)
