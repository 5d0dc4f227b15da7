"""The multi-process test harness itself: results, a failing rank, a hanging rank."""

import time

import pytest
import torch
import torch.distributed as dist

from densetrain.testing.distributed import DistributedTestError, run_distributed


def _sum_of_ranks(rank: int, world: int) -> float:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value.item()


def _rank1_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def _all_hang(rank: int, world: int) -> int:
    time.sleep(3600)
    return rank


def test_results_come_back_per_rank():
    assert run_distributed(_sum_of_ranks, 3) == [3.0, 3.0, 3.0]


def test_a_hanging_rank_is_named_within_the_timeout():
    # 20 s: the healthy rank must start (spawn, import torch, join gloo) and finish inside the
    # window even on a loaded 2-core machine, where 8 s was seen not to be enough
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[1\] of 2 produced no result "
                                                   r"within 20 s"):
        run_distributed(_rank1_hangs, 2, timeout=20)
    assert time.monotonic() - start < 45


def test_ranks_that_all_hang_cost_one_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0, 1\] of 2"):
        run_distributed(_all_hang, 2, timeout=10)
    assert time.monotonic() - start < 15  # not one timeout per join
