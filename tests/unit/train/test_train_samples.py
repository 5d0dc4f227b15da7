"""Samples and validation during training (``logging.sample_interval``, ``eval.interval``): they
leave the training itself untouched, and a pipelined run on two gloo ranks (the sample gathers
both stages' weights) generates the same seeded text as one process at the same step; the default
sample (a validation prompt, temperature 0.8, top-k 40, top-p 0.95) is readable text, not a loop,
and the same for the same seed."""

from __future__ import annotations

import pytest

from densetrain.testing import run_distributed
from densetrain.train import read_metrics, train
from densetrain.train.callbacks import Callback

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
    assert err.count("sample at step ") == 2
    assert err.count("(temperature 0.8, top-k 40, top-p 0.95, seed 0) from the first 32 tokens "
                     "of the validation split:") == 2
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
    assert results[0]["samples"] == summary["samples"]  # same seeded text at step 2
    assert results[0]["sample"] == summary["sample"]
    assert results[1]["samples"] == [{"step": 2, "text": ""}]  # rank 1 only takes part
    two = read_metrics(pp_dir)
    assert [r["step"] for r in two if "val_loss" in r] == [2, 4]
    assert [r["val_loss"] for r in two if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in with_samples if "val_loss" in r], rel=1e-4, abs=1e-5)


class _Tokenizer(Callback):
    """Keeps the run's tokenizer, to count the sample's tokens."""

    def on_train_start(self, parts, progress) -> None:
        self.tokenizer = parts.data.tokenizer


def _longest_run(ids: list[int]) -> int:
    longest = run = 0
    for i, token in enumerate(ids):
        run = run + 1 if i and token == ids[i - 1] else 1
        longest = max(longest, run)
    return longest


def test_the_default_sample_is_text_not_a_loop_and_the_same_for_the_same_seed(make_job,
                                                                              capfd) -> None:
    """The tiny job trained 40 steps, sampled as the default run samples (only the length is
    the test's): printable text without one token repeated more than 8 times in a row, from a
    validation prompt; the same run again gives the same text."""
    job = ["--training.steps=40", "--eval.interval=0", "--eval.sample_tokens=48",
           "--checkpoint.enabled=false", "--logging.plot=false"]
    tokenizer = _Tokenizer()
    first = train(make_job(*job, run="first"), callbacks=[tokenizer])
    sample = first["sample"]
    ids = tokenizer.tokenizer.encode(sample)
    assert len(ids) >= 24, sample  # not cut short by an early EOS
    assert all(c.isprintable() or c in "\n\t" for c in sample), repr(sample)
    assert _longest_run(ids) <= 8, repr(sample)
    assert first["sample_prompt"] and first["sample_prompt"] != sample
    again = train(make_job(*job, run="again"))
    assert again["sample"] == sample
    err = capfd.readouterr().err
    assert err.count("sample at step 40 (temperature 0.8, top-k 40, top-p 0.95, seed 0)") == 2
