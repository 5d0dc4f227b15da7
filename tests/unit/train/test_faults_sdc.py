"""Silent data corruption: a real bit flip in one replica's parameters is caught by the
cross-replica checksum, which names the tensor and the rank."""

from __future__ import annotations

import pytest
import torch

from densetrain.testing import DistributedTestError, run_distributed
from densetrain.train.sdc import checksum, disagreeing

FLIPPED_RANK, FLIP_AFTER_STEP = 1, 3


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of element ``index`` of a float32 tensor in place."""
    as_int = tensor.detach().view(-1).view(torch.int32)
    as_int[index] ^= 1 << bit


@pytest.mark.parametrize("bit", [0, 7, 22, 30, 31])
def test_checksum_changes_for_any_single_flipped_bit(bit: int) -> None:
    tensor = torch.randn(257, generator=torch.Generator().manual_seed(bit))
    before = int(checksum(tensor))
    flip_bit(tensor, 100, bit)
    assert int(checksum(tensor)) != before
    flip_bit(tensor, 100, bit)
    assert int(checksum(tensor)) == before
    halves = torch.randn(8).to(torch.bfloat16)
    assert int(checksum(halves)) == int(halves.view(torch.int16).sum(dtype=torch.int64))


def test_disagreeing_names_the_minority_or_everyone_without_a_majority() -> None:
    assert disagreeing([5, 5, 5]) == []
    assert disagreeing([5, 6, 5]) == [1]
    assert disagreeing([5, 6]) == [0, 1]


def _train_flipping(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config
    from densetrain.train import Callback, train

    class FlipOneBit(Callback):
        def on_step_end(self, parts, progress, report) -> None:
            if parts.rank == FLIPPED_RANK and progress.step == FLIP_AFTER_STEP:
                weight = parts.model.module.layers["0"].mlp.w_up.weight
                flip_bit(weight, 5, 20)

    return train(load_job_config(None, overrides), callbacks=[FlipOneBit()])


@pytest.mark.slow
def test_flipped_bit_on_one_of_three_replicas_is_named(corpus_cache, tiny_overrides,
                                                       tmp_path) -> None:
    overrides = tiny_overrides + [
        f"--data.cache_dir={corpus_cache}", f"--logging.run_dir={tmp_path / 'run'}",
        "--training.steps=6", "--training.global_batch_size=12", "--eval.interval=0",
        "--eval.sample_tokens=0", "--checkpoint.enabled=false", "--logging.plot=false",
        "--parallel.dp_replicate=3", "--faults.sdc_check_interval=2",
    ]
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_train_flipping, 3, overrides, timeout=240)
    text = str(err.value)
    assert "SilentDataCorruptionError: step 4:" in text  # the first check after the flip
    assert "layers.0.mlp.w_up.weight" in text
    assert f"rank(s) [{FLIPPED_RANK}] differ from the majority" in text
