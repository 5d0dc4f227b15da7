"""A pipelined run resumes its own checkpoint: two gloo ranks (pp 2, 1F1B) train 6 steps with
checkpoints every 2; the last checkpoint is removed and the run resumed from step 4 repeats
steps 5 and 6 bit for bit. Each stage's optimizer param groups are saved under their
parameters' names: keyed by group index, DCP kept one copy of "param group 0" (the first
stage's) for every stage, and the second stage's resumed step failed (KeyError 'betas')."""

from __future__ import annotations

import shutil

from densetrain.checkpoint.manager import checkpoint_name
from densetrain.testing import run_distributed
from densetrain.train import read_metrics, train

COMMON = ["--training.steps=6", "--eval.interval=0", "--eval.sample_tokens=0",
          "--checkpoint.interval=2", "--checkpoint.keep_last=0", "--logging.plot=false",
          "--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.dp_shard=1"]


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    return train(load_job_config(None, overrides))


def test_pipelined_run_resumes_its_own_checkpoint_exactly(tiny_overrides, corpus_cache,
                                                          tmp_path) -> None:
    run_dir = tmp_path / "pp"
    overrides = tiny_overrides + COMMON + [f"--data.cache_dir={corpus_cache}",
                                           f"--logging.run_dir={run_dir}"]
    run_distributed(_train_on_rank, 2, overrides, timeout=300)
    undisturbed = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert sorted(undisturbed) == [1, 2, 3, 4, 5, 6]

    shutil.rmtree(run_dir / "checkpoints" / checkpoint_name(6))
    results = run_distributed(_train_on_rank, 2, overrides, timeout=300)
    assert all(r["resumed_from"].endswith(checkpoint_name(4)) for r in results)
    resumed = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert {s: resumed[s] for s in (5, 6)} == {s: undisturbed[s] for s in (5, 6)}
