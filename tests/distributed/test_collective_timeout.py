"""A rank that stops taking part in collectives makes the others fail after the timeout, with an
error naming the rank and the step (not a hang)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from densetrain.parallel.distributed import CollectiveError, collective_step, init_distributed
from densetrain.testing import run_distributed

HANG_STEP = 2
TIMEOUT_S = 3.0


def _one_rank_hangs(rank: int, world: int) -> str:
    info = init_distributed(timeout_s=600)  # reuses the helper's group
    assert (info.rank, info.world_size) == (rank, world)
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    for step in range(4):
        if rank == 1 and step == HANG_STEP:
            time.sleep(TIMEOUT_S + 4)  # hangs past the timeout, then leaves
            return "left"
        start = time.monotonic()
        try:
            with collective_step(step):
                dist.all_reduce(torch.ones(4), group=group)
        except CollectiveError as err:
            return f"{err} after {time.monotonic() - start:.1f}s"
    return "finished"


def test_hung_rank_makes_peer_fail_with_rank_and_step():
    start = time.monotonic()
    results = run_distributed(_one_rank_hangs, 2, timeout=120)
    message = results[0]
    assert message.startswith(f"rank 0 of 2 failed at step {HANG_STEP}"), message
    waited = float(message.rsplit(" after ", 1)[1].rstrip("s"))
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 30, message
    assert results[1] == "left"
    assert time.monotonic() - start < 100
