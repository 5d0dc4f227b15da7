"""Per-rank heartbeats in the process group's store, so that a rank whose collective failed (or
whose hang watchdog fired) can name the peer that died or stopped.

Every rank's daemon thread writes one small record — rank, step, host, pid, wall time and a
counter — under its own key every `INTERVAL_S`, and sooner (at most every `MIN_GAP_S`) when the
rank starts a new step, so that the step a lost rank is named with is its last one. When
something goes wrong a rank reads every record twice, `OBSERVE_S` apart (`Heartbeat.diagnose`):

* a rank whose counter did not move in that time has stopped: killed, SIGSTOPped, or its host
  is gone. The counter decides, not the wall time, because the clocks of different hosts may
  disagree; the wall time only gives the "seconds since its last heartbeat" of the message.
* else a rank whose counter moves but whose step is behind the others' is stuck in Python (its
  heartbeat thread still runs while its main thread does not reach the collective).

A peer on this rank's own host needs no watching: its process, found by the pid of its record,
is gone, a zombie or stopped (``/proc/<pid>/stat``), or alive, which the diagnosis reads at once
(`local_state`), so a survivor on the host of a killed or stopped rank names it in milliseconds
instead of `OBSERVE_S`. A stopped peer on this host is then killed (SIGKILL: `fence_stopped`):
the launcher stops a failed group with SIGTERM and waits 30 s before its SIGKILL (torchrun's
restart path does not take ``--shutdown-timeout``), and a stopped process cannot act on SIGTERM,
so without it every restart after a hang waits those 30 s. The process killed is checked to be
that rank of this job (its environment's ``RANK`` and ``MASTER_PORT``) before the signal.

Every survivor reads the same store, so every survivor names the same rank. A rank that is
itself reporting a failure marks its record ``reporting``; once it has exited, the others do
not take it for the lost one. If the store does not answer, the process hosting it is gone:
that is rank 0 (the store host) for a process group made from ``MASTER_ADDR``/``MASTER_PORT``.

Cost: one ``set`` of about 150 bytes per rank per second, or per step when steps are longer
than `MIN_GAP_S` and shorter than a second (at most five per second with steps shorter still),
on a connection of its own (so it never queues behind the main thread's store calls). For N
ranks that is N to 5N small requests per second to the store's server thread, which serves tens
of thousands; on each rank the thread holds the GIL for the few microseconds that checking the
step and building the record take. Nothing is read until a failure.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
"""Seconds between two heartbeats of a rank whose step does not change."""

MIN_GAP_S = 0.2
"""Least seconds between two heartbeats (a new step is published after at most this long)."""

OBSERVE_S = 3.5
"""How long a diagnosis watches the counters: three heartbeats and a half, so that a rank
alive but slowed (a busy GIL, a loaded store) still shows at least one new beat."""

STORE_TIMEOUT_S = 5.0
"""How long one store request may take before the store counts as unreachable."""

RUNNING, REPORTING = "running", "reporting"


@dataclass(frozen=True)
class Beat:
    """One heartbeat record as stored."""

    rank: int
    step: int
    host: str
    pid: int
    time: float  # wall clock (time.time()) of the writer, for the message only
    count: int
    state: str = RUNNING

    def encode(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @staticmethod
    def decode(raw: bytes) -> Beat:
        return Beat(**json.loads(raw))


@dataclass(frozen=True)
class LostRank:
    """A rank a diagnosis blames: ``stopped`` (no heartbeat while watched; ``beat`` is its last
    record, None if it never wrote one) or ``behind`` (beating, but at an older step)."""

    rank: int
    reason: str
    beat: Beat | None
    now: float
    ahead_step: int = 0
    fenced: bool = False
    """The stopped process was killed by this rank (`fence_stopped`)."""

    def describe(self, world_size: int) -> str:
        if self.beat is None:
            return f"rank {self.rank} of {world_size} is lost: it never wrote a heartbeat"
        where = f"host {self.beat.host}, pid {self.beat.pid}"
        if self.reason in (GONE, ZOMBIE, SUSPENDED):  # seen on this host's /proc
            what = {GONE: "its process is gone", ZOMBIE: "its process exited",
                    SUSPENDED: "its process is stopped"}[self.reason]
            if self.fenced:
                what += " (killed, so that the restart need not wait for it)"
            return (f"rank {self.rank} of {world_size} ({where}) is lost: last seen at step "
                    f"{self.beat.step}; {what}")
        if self.reason == "behind":
            return (f"rank {self.rank} of {world_size} ({where}) is stuck at step "
                    f"{self.beat.step} while others are at step {self.ahead_step} (its "
                    f"heartbeat still runs)")
        age = max(0.0, self.now - self.beat.time)
        return (f"rank {self.rank} of {world_size} ({where}) is lost: last seen at step "
                f"{self.beat.step}, no heartbeat for {age:.1f} s")


GONE, ZOMBIE, SUSPENDED, ALIVE = "gone", "zombie", "suspended", "alive"
"""`local_state` verdicts (a rank blamed with one of the first three was seen in /proc)."""


def local_state(pid: int) -> str:
    """The state of process ``pid`` on this host: `GONE`, `ZOMBIE` (exited, not yet reaped),
    `SUSPENDED` (SIGSTOP/SIGTSTP) or `ALIVE` (running, sleeping or in I/O), from
    ``/proc/<pid>/stat``; `ALIVE` where /proc is not there to say otherwise."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        return GONE
    except OSError:
        return ALIVE  # no /proc (not Linux) or not readable: no local verdict
    state = stat.rsplit(")", 1)[-1].split()[:1]
    if state == ["Z"] or state == ["X"]:
        return ZOMBIE
    if state == ["T"]:
        return SUSPENDED
    return ALIVE


def _same_job_rank(pid: int, rank: int) -> bool:
    """True when process ``pid`` is rank ``rank`` of this job: its environment's ``RANK``
    and ``MASTER_PORT`` are this process's (a pid reused by another process fails this)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    env = dict(e.split(b"=", 1) for e in entries if b"=" in e)
    port = os.environ.get("MASTER_PORT", "").encode()
    return env.get(b"RANK") == str(rank).encode() and env.get(b"MASTER_PORT", b"") == port


def fence_stopped(lost: LostRank) -> bool:
    """SIGKILL the stopped process of ``lost`` (on this host, verified to be that rank of this
    job) so that the restart need not wait the launcher's shutdown grace; True when killed."""
    beat = lost.beat
    if beat is None or lost.reason != SUSPENDED or not _same_job_rank(beat.pid, beat.rank):
        return False
    try:
        os.kill(beat.pid, signal.SIGKILL)
    except OSError:
        return False
    logger.warning("rank %d (pid %d) was stopped: killed it so the job can restart", beat.rank,
                   beat.pid)
    return True


class StoreUnreachable(RuntimeError):
    """The store holding the heartbeats does not answer."""


def find_lost(first: dict[int, Beat], second: dict[int, Beat], world_size: int, *,
              self_rank: int, now: float) -> list[LostRank]:
    """The ranks to blame given two reads of every record taken some seconds apart (pure).

    Stopped ranks come first; a stopped rank that was itself reporting a failure (it exited
    after naming another) is blamed only when no other rank stopped. With none stopped, the
    ranks whose step is behind the highest step of the beating ranks are named."""
    stopped, beating = [], []
    for rank in range(world_size):
        before, after = first.get(rank), second.get(rank)
        moved = after is not None and (before is None or after.count != before.count)
        if rank == self_rank or moved:
            if after is not None:
                beating.append(after)
        else:
            stopped.append(LostRank(rank=rank, reason="stopped", beat=after, now=now))
    running = [lost for lost in stopped if lost.beat is None or lost.beat.state != REPORTING]
    if running or stopped:
        return running or stopped
    if not beating:
        return []
    ahead = max(beat.step for beat in beating)
    return [LostRank(rank=beat.rank, reason="behind", beat=beat, now=now, ahead_step=ahead)
            for beat in beating if beat.step < ahead]


def _store_address(store: dist.Store) -> str:
    """``host:port`` of the TCPStore under ``store`` (prefix stores unwrapped), else ''."""
    for _ in range(8):
        if hasattr(store, "host") and hasattr(store, "port"):
            return f"{store.host}:{store.port}"
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return ""


class Heartbeat:
    """This rank's heartbeat thread and the reading of the others' (`diagnose`)."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int,
                 interval_s: float = INTERVAL_S, address: str = "") -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.address = address or _store_address(store)
        self.host = socket.gethostname()
        self.step = 0
        self.state = RUNNING
        self._count = 0
        self._stop = threading.Event()
        self._failed_once = False
        self.group_store: dist.Store | None = None  # the process group's store it serves
        self._beat()  # the first record exists before training starts
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def key(rank: int) -> str:
        return f"rank{rank}"

    def _beat(self) -> None:
        self._count += 1
        beat = Beat(rank=self.rank, step=self.step, host=self.host, pid=os.getpid(),
                    time=time.time(), count=self._count, state=self.state)
        try:
            self.store.set(self.key(self.rank), beat.encode())
        except Exception as err:  # the store host may be gone: keep trying, say it once
            if not self._failed_once:
                logger.debug("heartbeat of rank %d not written: %s", self.rank, err)
                self._failed_once = True

    def _run(self) -> None:
        last_time, last_step = time.monotonic(), self.step
        while not self._stop.wait(min(MIN_GAP_S, self.interval_s)):
            now, step = time.monotonic(), self.step
            if step != last_step or now - last_time >= self.interval_s:
                self._beat()
                last_time, last_step = now, step

    def read(self) -> dict[int, Beat]:
        """Every rank's latest record (ranks without one are absent); `StoreUnreachable` when
        the store does not answer."""
        beats = {}
        try:
            for rank in range(self.world_size):
                key = self.key(rank)
                if self.store.check([key]):  # get() would wait for a key never written
                    beats[rank] = Beat.decode(self.store.get(key))
        except Exception as err:
            raise StoreUnreachable(str(err)) from err
        return beats

    def diagnose(self, observe_s: float = OBSERVE_S) -> list[LostRank]:
        """The ranks to blame: peers on this host whose process is gone or stopped at once
        (`local_lost`), else those the records show stopped or behind over ``observe_s``
        seconds (see the module)."""
        self.state = REPORTING
        first = self.read()
        local = self.local_lost(first)
        if local:
            return local
        time.sleep(observe_s)
        second = self.read()
        return find_lost(first, second, self.world_size, self_rank=self.rank, now=time.time())

    def local_lost(self, beats: dict[int, Beat]) -> list[LostRank]:
        """The peers on this host (by their records' host and pid) whose process is gone, a
        zombie or stopped; the stopped ones are killed (`fence_stopped`). A peer that was itself
        reporting a failure and has exited is not blamed while another is."""
        lost = []
        for rank, beat in sorted(beats.items()):
            if rank == self.rank or beat.host != self.host:
                continue
            state = local_state(beat.pid)
            if state != ALIVE:
                lost.append(LostRank(rank=rank, reason=state, beat=beat, now=time.time()))
        running = [item for item in lost if item.beat.state != REPORTING]
        lost = running or lost
        return [dataclasses.replace(item, fenced=fence_stopped(item)) if item.reason == SUSPENDED
                else item for item in lost]

    def explain(self, observe_s: float = OBSERVE_S) -> str:
        """One phrase naming the lost rank(s), or saying that no rank could be named."""
        try:
            lost = self.diagnose(observe_s)
        except StoreUnreachable as err:
            logger.debug("heartbeat store unreachable: %s", err)
            where = f" at {self.address}" if self.address else ""
            return (f"rank 0 of {self.world_size} (the store host) is lost: the job's store"
                    f"{where} does not answer")
        if not lost:
            return ("every rank's heartbeat is alive and at the same step (a collective timeout"
                    " shorter than a step, or ranks that ran different collectives)")
        return "; ".join(item.describe(self.world_size) for item in lost)

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + STORE_TIMEOUT_S)


_current: Heartbeat | None = None


def _heartbeat_store() -> dist.Store:
    """A connection of its own to the default process group's store, under a prefix naming
    this launch attempt (torchrun restarts reuse one store: old records must not count)."""
    store = dist.distributed_c10d._get_default_store()
    try:
        own = store.clone()  # a new TCP connection; a FileStore/HashStore returns itself
        own.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    except (RuntimeError, AttributeError):
        own = store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"densetrain/heartbeat/{attempt}/", own)


def start_heartbeat() -> Heartbeat | None:
    """Start this rank's heartbeat on the default process group (once per group; None on a
    single process or when the store cannot be reached)."""
    global _current
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    if _current is not None and _current.group_store is store:
        return _current
    stop_heartbeat()  # one of an earlier process group
    try:
        _current = Heartbeat(_heartbeat_store(), rank=rank, world_size=world,
                             address=_store_address(store))
        _current.group_store = store
    except Exception as err:  # no heartbeat: failures then say less, training is unaffected
        logger.warning("rank %d: heartbeat not started (%s); a failed collective will not "
                       "name the lost rank", rank, err)
        _current = None
    return _current


def current_heartbeat() -> Heartbeat | None:
    """This process's running heartbeat, if any."""
    return _current


def note_step(step: int) -> None:
    """The step this rank is taking now (published with its next heartbeat)."""
    if _current is not None:
        _current.step = step


def stop_heartbeat() -> None:
    """Stop this process's heartbeat (its last record stays in the store)."""
    global _current
    if _current is not None:
        _current.close()
        _current = None
