"""Heartbeats in a real TCPStore: who is stopped, who is behind, and a store that is gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from densetrain.parallel.heartbeat import (
    REPORTING,
    Beat,
    Heartbeat,
    find_lost,
)

FAST = 0.1  # heartbeat interval of these tests (seconds)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server():
    """A TCPStore server and a factory of client connections to it, as ranks have."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))

    def client(prefix: str = "hb/") -> dist.Store:
        conn = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=2))
        return dist.PrefixStore(prefix, conn)

    yield store, client


def _beats(client, world: int) -> list[Heartbeat]:
    return [Heartbeat(client(), rank=r, world_size=world, interval_s=FAST) for r in range(world)]


def test_a_rank_whose_heartbeat_stops_is_named_with_host_and_step(server) -> None:
    _, client = server
    ranks = _beats(client, 3)
    try:
        for beat in ranks:
            beat.step = 12
        ranks[2].step = 11
        time.sleep(3 * FAST)
        ranks[2].close()  # as a SIGKILL or SIGSTOP: no more heartbeats
        lost = ranks[0].diagnose(observe_s=5 * FAST)
        assert [(x.rank, x.reason, x.beat.step) for x in lost] == [(2, "stopped", 11)]
        message = ranks[1].explain(observe_s=5 * FAST)  # another survivor names the same rank
        assert message.startswith(f"rank 2 of 3 (host {socket.gethostname()}, pid ")
        assert "last seen at step 11, no heartbeat for " in message
    finally:
        for beat in ranks:
            beat.close()


def test_a_beating_rank_behind_the_others_is_named_stuck(server) -> None:
    _, client = server
    ranks = _beats(client, 2)
    try:
        ranks[0].step, ranks[1].step = 8, 7
        time.sleep(3 * FAST)
        message = ranks[0].explain(observe_s=5 * FAST)
        assert "rank 1 of 2" in message and "is stuck at step 7 while others are at step 8" \
            in message, message
        ranks[1].step = 8
        time.sleep(3 * FAST)
        assert ranks[0].diagnose(observe_s=5 * FAST) == []
        assert "every rank's heartbeat is alive" in ranks[0].explain(observe_s=5 * FAST)
    finally:
        for beat in ranks:
            beat.close()


def test_a_rank_that_never_beat_is_named(server) -> None:
    _, client = server
    only = Heartbeat(client(), rank=0, world_size=2, interval_s=FAST)
    try:
        assert only.explain(observe_s=3 * FAST) == \
            "rank 1 of 2 is lost: it never wrote a heartbeat"
    finally:
        only.close()


def test_a_killed_store_host_is_named_as_rank_0(tmp_path) -> None:
    # The store's server lives in another process (as in rank 0), really killed.
    port = _free_port()
    host = subprocess.Popen([sys.executable, "-c", (
        "import time, datetime, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
        "print('up', flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        conn = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=2))
        survivor = Heartbeat(dist.PrefixStore("hb/", conn), rank=1, world_size=2,
                             interval_s=FAST, address=f"127.0.0.1:{port}")
        time.sleep(2 * FAST)
        os.kill(host.pid, signal.SIGKILL)
        host.wait(timeout=30)
        start = time.monotonic()
        message = survivor.explain(observe_s=FAST)
        survivor.close()
    finally:
        host.kill()
        host.wait(timeout=30)
    assert message == (f"rank 0 of 2 (the store host) is lost: the job's store at "
                       f"127.0.0.1:{port} does not answer")
    assert time.monotonic() - start < 15


def test_find_lost_prefers_a_silent_running_rank_over_one_that_reported() -> None:
    def beat(rank, count, step=5, state="running"):
        return Beat(rank=rank, step=step, host="h", pid=rank, time=100.0, count=count,
                    state=state)

    first = {0: beat(0, 1), 1: beat(1, 1, state=REPORTING), 2: beat(2, 1)}
    second = {0: beat(0, 4), 1: beat(1, 1, state=REPORTING), 2: beat(2, 1)}
    lost = find_lost(first, second, 3, self_rank=0, now=104.0)
    assert [x.rank for x in lost] == [2]
    second[2] = beat(2, 3)  # rank 2 beats: only the rank that reported and left is silent
    assert [x.rank for x in find_lost(first, second, 3, self_rank=0, now=104.0)] == [1]
