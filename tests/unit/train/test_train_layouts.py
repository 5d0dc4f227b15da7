"""The trainer on two gloo ranks for the layouts beyond FSDP2: ZeRO-1/2, context parallel and
pipeline parallel. Each run's per-step losses are compared with the one-process run of the same
job (the reference), and ZeRO-2 resumes exactly from its own checkpoint.

Tolerance: the layouts reorder float32 sums (gradient reduction over ranks, attention over
gathered keys, micro-batch losses), which moves the losses by a few ulps per step and lets the
difference grow through four AdamW updates; rel 1e-4 / abs 1e-5 is far below the step-to-step
loss change (about 1e-2) and catches any wrong averaging (a factor of 2 in a gradient).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from densetrain.testing import run_distributed
from densetrain.train import read_metrics, train

COMMON = ["--training.steps=4", "--eval.interval=0", "--eval.sample_tokens=0",
          "--logging.plot=false"]
LOSS_TOLERANCE = {"rel": 1e-4, "abs": 1e-5}


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    return train(load_job_config(None, overrides))


def _zero_run_and_resume(rank: int, world_size: int, overrides: list[str], full_dir: str,
                         resumed_dir: str) -> tuple[dict, dict]:
    """Train 4 steps (checkpoints at 2 and 4), then resume a copy of the step-2 checkpoint."""
    import torch.distributed as dist

    from densetrain.config import load_job_config

    full = train(load_job_config(None, overrides + [f"--logging.run_dir={full_dir}"]))
    if rank == 0:
        shutil.copytree(Path(full_dir) / "checkpoints" / "step-00000002",
                        Path(resumed_dir) / "checkpoints" / "step-00000002")
    dist.barrier()
    resumed = train(load_job_config(None, overrides + [f"--logging.run_dir={resumed_dir}"]))
    return full, resumed


def _reference_metrics(make_job, *overrides: str) -> list[dict]:
    single = make_job(*COMMON, *overrides, run="single")
    train(single)
    return read_metrics(single.logging.run_dir)


def _rank_overrides(make_job, tiny_overrides: list[str], *extra: str) -> list[str]:
    cache = make_job().data.cache_dir
    return tiny_overrides + COMMON + [f"--data.cache_dir={cache}", *extra]


def test_zero2_matches_one_process_and_resumes_exactly(make_job, tiny_overrides,
                                                      tmp_path) -> None:
    # Clipping on (0.5 is below the early gradient norms), so the ZeroOptimizer's clipping over
    # gradient shards is compared with the one-process clip_grad_norm_.
    one = _reference_metrics(make_job, "--checkpoint.enabled=false", "--optim.grad_clip=0.5")
    overrides = _rank_overrides(make_job, tiny_overrides, "--parallel.dp_shard=2",
                                "--parallel.zero_stage=2", "--checkpoint.interval=2",
                                "--checkpoint.keep_last=0", "--optim.grad_clip=0.5")
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    results = run_distributed(_zero_run_and_resume, 2, overrides, str(full_dir),
                              str(resumed_dir), timeout=240)
    (full0, resumed0), (full1, _) = results
    assert full0["final_loss"] == full1["final_loss"]
    two = [r["loss"] for r in read_metrics(full_dir)]
    assert two == pytest.approx([r["loss"] for r in one], **LOSS_TOLERANCE)
    assert [r["grad_norm"] for r in read_metrics(full_dir)] == pytest.approx(
        [r["grad_norm"] for r in one], **LOSS_TOLERANCE)
    assert resumed0["resumed_from"].endswith("step-00000002")
    resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == two[2:]  # bit-exact continuation
    assert resumed0["final_loss"] == full0["final_loss"]


def test_zero_checkpoint_on_other_world_size_is_refused(make_job, tiny_overrides,
                                                        tmp_path) -> None:
    overrides = _rank_overrides(make_job, tiny_overrides, "--parallel.dp_shard=2",
                                "--parallel.zero_stage=1", "--checkpoint.interval=2",
                                "--training.steps=2", "--schedule.warmup_steps=1",
                                f"--logging.run_dir={tmp_path / 'z'}")
    run_distributed(_train_on_rank, 2, overrides, timeout=240)
    resumed = make_job(*COMMON, f"--checkpoint.dir={tmp_path / 'z' / 'checkpoints'}",
                       run="resumed")
    with pytest.raises(ValueError, match="world size"):
        train(resumed)


def test_context_parallel_matches_one_process(make_job, tiny_overrides, tmp_path) -> None:
    # eval on: the validation loss also goes through the sharded sequences.
    evals = ["--eval.interval=4", "--checkpoint.enabled=false"]
    single = make_job(*COMMON, *evals, run="single")
    train(single)
    cp_dir = tmp_path / "cp"
    overrides = _rank_overrides(make_job, tiny_overrides, *evals, "--parallel.cp=2",
                                "--parallel.dp_shard=1", f"--logging.run_dir={cp_dir}")
    results = run_distributed(_train_on_rank, 2, overrides, timeout=240)
    assert results[0]["final_loss"] == results[1]["final_loss"]
    one, two = read_metrics(single.logging.run_dir), read_metrics(cp_dir)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], **LOSS_TOLERANCE)
    # Adam hides a uniform gradient scale in the losses; the reported norm does not.
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one],
                                                          **LOSS_TOLERANCE)
    assert two[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], **LOSS_TOLERANCE)


def test_pipeline_matches_one_process(make_job, tiny_overrides, tmp_path) -> None:
    single = make_job(*COMMON, "--checkpoint.enabled=false", run="single")
    train(single)
    pp_dir = tmp_path / "pp"
    overrides = _rank_overrides(make_job, tiny_overrides, "--parallel.pp=2",
                                "--parallel.pp_schedule=1f1b", "--parallel.dp_shard=1",
                                "--checkpoint.interval=4", f"--logging.run_dir={pp_dir}")
    results = run_distributed(_train_on_rank, 2, overrides, timeout=240)
    assert results[0]["final_loss"] == results[1]["final_loss"]
    one, two = read_metrics(single.logging.run_dir), read_metrics(pp_dir)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], **LOSS_TOLERANCE)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one],
                                                          **LOSS_TOLERANCE)
    # The stage checkpoint holds the full model's names: it continues on one process.
    resumed = make_job("--training.steps=6", "--eval.interval=0", "--eval.sample_tokens=0",
                       "--logging.plot=false", f"--checkpoint.dir={pp_dir / 'checkpoints'}",
                       run="resumed")
    summary = train(resumed)
    assert summary["resumed_from"].endswith("step-00000004")
    assert [r["step"] for r in read_metrics(resumed.logging.run_dir)] == [5, 6]



@pytest.mark.slow
def test_interleaved_pipeline_with_fsdp_matches_one_process(make_job, tiny_overrides,
                                                            tmp_path) -> None:
    # 4 ranks: pp 2 (two virtual stages each, so 4 stages of one layer) × FSDP over dp_shard 2.
    layers = "--model.num_layers=4"
    single = make_job(*COMMON, layers, "--checkpoint.enabled=false", run="single")
    train(single)
    pp_dir = tmp_path / "pp_fsdp"
    overrides = _rank_overrides(make_job, tiny_overrides, layers, "--parallel.pp=2",
                                "--parallel.pp_schedule=interleaved_1f1b",
                                "--parallel.pp_virtual_stages=2", "--parallel.pp_microbatches=2",
                                "--parallel.dp_shard=2", "--checkpoint.enabled=false",
                                f"--logging.run_dir={pp_dir}")
    run_distributed(_train_on_rank, 4, overrides, timeout=600)
    one, four = read_metrics(single.logging.run_dir), read_metrics(pp_dir)
    assert [r["loss"] for r in four] == pytest.approx([r["loss"] for r in one], **LOSS_TOLERANCE)
    assert [r["grad_norm"] for r in four] == pytest.approx([r["grad_norm"] for r in one],
                                                           **LOSS_TOLERANCE)
