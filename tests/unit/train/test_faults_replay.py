"""Deterministic replay: a step computed twice matches bit for bit on CPU and leaves the run's
trajectory unchanged; a bit flipped in one computation's gradient is named."""

from __future__ import annotations

import pytest
import torch

from densetrain.train import Callback, read_metrics, train
from densetrain.train.faults import SilentDataCorruptionError

COMMON = ("--training.steps=4", "--eval.interval=0", "--eval.sample_tokens=0",
          "--checkpoint.enabled=false", "--logging.plot=false")


class _FlipGradientOnce(Callback):
    """After step ``at``, a hook flips bit 20 of one gradient element in the next backward."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step != self.at:
            return
        weight = parts.model.module.layers["0"].mlp.w_up.weight
        handle = None

        def flip(grad: torch.Tensor) -> torch.Tensor:
            handle.remove()  # once
            flipped = grad.clone()
            flipped.view(-1).view(torch.int32)[3] ^= 1 << 20
            return flipped

        handle = weight.register_hook(flip)


def test_replay_matches_and_does_not_change_the_run(make_job) -> None:
    plain = make_job(*COMMON, run="plain")
    replayed = make_job(*COMMON, "--faults.sdc_replay_interval=2", run="replayed")
    train(plain)
    train(replayed)
    assert [r["loss"] for r in read_metrics(replayed.logging.run_dir)] == [
        r["loss"] for r in read_metrics(plain.logging.run_dir)]


def test_flipped_gradient_bit_is_caught_by_the_replay(make_job) -> None:
    job = make_job(*COMMON, "--faults.sdc_replay_interval=4")
    with pytest.raises(SilentDataCorruptionError,
                       match=r"step 4 computed twice .* \(rank 0: layers\.0\.mlp\.w_up\.weight\); "
                             r"suspect rank\(s\) \[0\]"):
        train(job, callbacks=[_FlipGradientOnce(at=3)])


CORRUPT_RANK = 1


def _train_corrupting_one_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    """Rank ``CORRUPT_RANK`` flips one bit of an activation in one forward pass of step 4 (the
    first of the replay's two computations); every other rank computes honestly."""
    from densetrain.config import load_job_config

    class FlipActivationOnce(Callback):
        def on_step_end(self, parts, progress, report) -> None:
            if parts.rank != CORRUPT_RANK or progress.step != 3:
                return
            mlp = parts.model.module.layers["0"].mlp
            handle = None

            def flip(_module, _inputs, output):
                handle.remove()  # once: the replay's second computation is clean
                flipped = output.clone()
                flipped.view(-1).view(torch.int32)[7] ^= 1 << 22
                return flipped

            handle = mlp.w_up.register_forward_hook(flip)

    return train(load_job_config(None, overrides), callbacks=[FlipActivationOnce()])


def test_replay_names_the_one_rank_that_computed_wrongly(corpus_cache, tiny_overrides,
                                                          tmp_path) -> None:
    """Under data parallel the reduced gradients differ on every rank, but only the corrupted
    rank's own loss differs, and it alone is named."""
    from densetrain.testing import DistributedTestError, run_distributed

    overrides = tiny_overrides + [
        f"--data.cache_dir={corpus_cache}", f"--logging.run_dir={tmp_path / 'run'}",
        *COMMON, "--parallel.dp_replicate=2", "--faults.sdc_replay_interval=4",
    ]
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_train_corrupting_one_rank, 2, overrides, timeout=240)
    text = str(err.value)
    assert "SilentDataCorruptionError" in text and "step 4 computed twice" in text
    assert f"rank {CORRUPT_RANK}: loss" in text
    assert f"suspect rank(s) [{CORRUPT_RANK}]" in text
