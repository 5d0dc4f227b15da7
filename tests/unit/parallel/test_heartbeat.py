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
    ALIVE,
    GONE,
    REPORTING,
    SUSPENDED,
    ZOMBIE,
    Beat,
    Heartbeat,
    find_lost,
    local_state,
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


def _sleeper(**env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, **env})


def test_local_state_reads_proc_for_a_real_process() -> None:
    child = _sleeper()
    try:
        assert local_state(child.pid) == ALIVE
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while local_state(child.pid) != SUSPENDED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local_state(child.pid) == SUSPENDED
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while local_state(child.pid) != ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local_state(child.pid) == ZOMBIE  # dead, not yet reaped
    finally:
        child.kill()
        child.wait()
    assert local_state(child.pid) == GONE


def _record(store: dist.Store, rank: int, pid: int, step: int, state: str = "running") -> None:
    beat = Beat(rank=rank, step=step, host=socket.gethostname(), pid=pid, time=time.time(),
                count=1, state=state)
    store.set(Heartbeat.key(rank), beat.encode())


def test_a_peer_on_this_host_is_named_at_once_and_a_stopped_one_is_killed(
        server, monkeypatch) -> None:
    """Ranks 1 (killed) and 2 (stopped) are real processes of this host; rank 3 lives. The
    diagnosis needs no observation window, and kills the stopped rank only when its environment
    says it is that rank of this job."""
    _, client = server
    monkeypatch.setenv("MASTER_PORT", "29517")
    killed = _sleeper(RANK="1", MASTER_PORT="29517")
    stopped = _sleeper(RANK="2", MASTER_PORT="29517")
    alive = _sleeper(RANK="3", MASTER_PORT="29517")
    stranger = _sleeper(RANK="2", MASTER_PORT="1")  # another job's rank 2
    me = Heartbeat(client(), rank=0, world_size=4, interval_s=FAST)
    store = client()
    try:
        killed.kill()
        killed.wait()
        stopped.send_signal(signal.SIGSTOP)
        stranger.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        for rank, child, step in ((1, killed, 7), (2, stopped, 8), (3, alive, 9)):
            _record(store, rank, child.pid, step)
        start = time.monotonic()
        lost = me.diagnose(observe_s=30)  # would take 30 s without the local verdict
        assert time.monotonic() - start < 5
        assert [(x.rank, x.reason, x.beat.step, x.fenced) for x in lost] == [
            (1, GONE, 7, False), (2, SUSPENDED, 8, True)]
        assert stopped.wait(timeout=5) == -signal.SIGKILL
        text = lost[1].describe(4)
        assert text == (f"rank 2 of 4 (host {socket.gethostname()}, pid {stopped.pid}) is lost: "
                        "last seen at step 8; its process is stopped (killed, so that the "
                        "restart need not wait for it)")
        # a stopped process that is not this job's rank is named but never killed
        _record(store, 2, stranger.pid, 8)
        lost = me.diagnose(observe_s=30)
        assert [(x.rank, x.reason, x.fenced) for x in lost] == [(1, GONE, False),
                                                                (2, SUSPENDED, False)]
        assert local_state(stranger.pid) == SUSPENDED
    finally:
        me.close()
        for child in (killed, stopped, alive, stranger):
            child.kill()
            child.wait()
