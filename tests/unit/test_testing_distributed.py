"""The gloo test harness runs real collectives and reports a failing rank."""

import pytest
import torch
import torch.distributed as dist

from densetrain.testing import DistributedTestError, run_distributed


def _all_reduce_rank(rank: int, world_size: int, scale: int) -> float:
    t = torch.tensor([float(rank * scale)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_all_reduce_sums_over_ranks():
    out = run_distributed(_all_reduce_rank, 3, 2)
    assert out == [6.0, 6.0, 6.0]  # 2 * (0 + 1 + 2)


def test_failing_rank_is_named():
    with pytest.raises(DistributedTestError, match="rank 1 of 2 failed"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)
