"""Tied input/output embeddings under pipeline parallel through ``train()`` on two gloo ranks:
the same losses and gradient norms as one process, and a checkpoint that one process resumes
(the last stage's copy of the embedding is saved under the one name)."""

from __future__ import annotations

import pytest

from densetrain.testing import run_distributed
from densetrain.train import read_metrics, train

COMMON = ["--model.tie_embeddings=true", "--eval.interval=0", "--eval.sample_tokens=0",
          "--checkpoint.interval=4", "--logging.plot=false"]
PP = ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.dp_shard=1"]


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    return train(load_job_config(None, overrides))


def _column(run_dir, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run_dir)]


def test_pipelined_tied_run_matches_one_process_and_resumes(make_job, tiny_overrides,
                                                            tmp_path) -> None:
    single = make_job(*COMMON, "--training.steps=6", run="single")
    train(single)
    pp_dir = tmp_path / "pp"
    overrides = tiny_overrides + COMMON + PP + [
        f"--data.cache_dir={single.data.cache_dir}", f"--logging.run_dir={pp_dir}",
    ]
    results = run_distributed(_train_on_rank, 2, overrides + ["--training.steps=4"], timeout=300)
    assert results[0]["final_loss"] == results[1]["final_loss"]
    one_loss, one_norm = _column(single.logging.run_dir, "loss"), _column(
        single.logging.run_dir, "grad_norm")
    assert _column(pp_dir, "loss") == pytest.approx(one_loss[:4], rel=1e-4, abs=1e-5)
    # the tied matrix counts once in the norm (each stage holds a copy)
    assert _column(pp_dir, "grad_norm") == pytest.approx(one_norm[:4], rel=1e-4)

    # One process resumes from the pipeline's checkpoint (one tok_embeddings.weight, under the
    # model's name, loaded into its one matrix).
    alone = make_job(*COMMON, "--training.steps=6",
                     f"--checkpoint.dir={pp_dir / 'checkpoints'}", run="alone")
    summary = train(alone)
    assert summary["resumed_from"].endswith("step-00000004")
    records = read_metrics(alone.logging.run_dir)
    assert [r["step"] for r in records] == [5, 6]
