"""Stragglers: a rank the others wait for, named with its host, how much slower, since when.

Ranks of a data-parallel job run in lockstep: every step ends, on every rank, when the step's
collectives complete, so all ranks see the same step time. What differs is where it goes. A
slow rank reaches the step's collectives late and hardly waits; the others wait for it. So each
rank marks, per step, three points on its own clock (no clocks are compared across hosts):

* ``end``: the step's update is done (the loop enters its fault checks). The *window* of step
  k runs from the previous step's ``end`` to its own: evaluation, callbacks, checkpoint saves
  and the reading of the batch of the previous iteration, then step k.
* ``block``: where step k's first blocking collective starts: the step's start (FSDP, tensor,
  context and pipeline parallel gather or exchange in the forward), or, under plain DDP, the
  last micro-batch's backward, whose gradient all-reduce is where the ranks meet
  (`SpmdModel.before_reduction`).
* the loop's other blocking points, bracketed: the fault checks (the loss all-reduce, replica
  checks and this module's own all-gather), the loss all-reduce of the metrics logger
  (`evaluation.mean_over_ranks`, through `blocking_point`) and the preemption vote.

``blocked`` = ``block``→``end`` plus those: compute after the reduction starts, the gradient
reduction, the host sync of the finiteness check, the optimizer step and the all-reduces.
Across ranks, the one that blocked least is the one the others waited for, so
``wait_r = blocked_r - min(blocked)`` (the shared compute and transfer cancel out) and
``compute_r = window_r - wait_r``. A rank whose compute exceeds the median rank's (the lower
median, so that with two ranks the other rank is the reference) by ``faults.straggler_factor``
for ``faults.straggler_steps`` measured steps in a row is a straggler. Slowness that falls
after the ``block`` mark (backward compute overlapped with the DDP reduction) is counted as
waiting on every rank alike and is not seen; anything before it is: data loading, callbacks,
Python, host stalls, a stopped process, and on a GPU the forward pass (CUDA events time the
device's stream, not the host's launches).

Cost (negligible by construction; no per-collective hooks): per step three timestamps
(``time.perf_counter`` on CPU; on a GPU, CUDA events recorded on the current stream without
any synchronisation) and a few float additions; every ``faults.straggler_interval`` steps one
all-gather of ``2 × interval`` float64 values per rank (320 bytes at the default 10) plus, on
a GPU, one wait for the last event. Measured on two gloo CPU ranks (a shared 2-core machine):
the marks ~1 µs per step, the all-gather and verdict ~0.9 ms per interval, so ~0.1 ms per step
at the default interval of 10, about 0.2% of the tiny test model's ~40 ms step and far less of
a real one.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from densetrain.config.sections import FaultsConfig

__all__ = ["Straggler", "StragglerMonitor", "StepTiming", "blocking_point", "split_waiting"]

_ACTIVE: weakref.ref[StragglerMonitor] | None = None
"""The running loop's monitor (a weak reference: a finished run's monitor goes away)."""


@contextlib.contextmanager
def blocking_point() -> Iterator[None]:
    """Bracket a collective of the loop outside the step (its time is blocked, not compute)."""
    monitor = _ACTIVE() if _ACTIVE is not None else None
    if monitor is None or not monitor.enabled or monitor._open:
        yield
        return
    monitor.checks_started()
    try:
        yield
    finally:
        monitor.checks_ended()


@dataclass
class Straggler:
    """A rank named slow: its host, its compute over the median rank's, since which step."""

    rank: int
    host: str
    factor: float
    since_step: int

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (metrics.jsonl, goodput.jsonl)."""
        return {"rank": self.rank, "host": self.host, "factor": round(self.factor, 3),
                "since_step": self.since_step}


@dataclass
class StepTiming:
    """One measured step on every rank: ``compute`` and ``wait`` seconds per rank."""

    step: int
    compute: list[float]
    wait: list[float]

    def factors(self) -> list[float]:
        """Each rank's compute over the (lower) median rank's."""
        reference = statistics.median_low(self.compute)
        return [c / reference if reference > 0 else 1.0 for c in self.compute]


def split_waiting(step: int, windows: list[float], blocked: list[float]) -> StepTiming:
    """Per-rank compute and wait of one step from each rank's window and blocked seconds."""
    least = min(blocked)
    wait = [b - least for b in blocked]
    compute = [max(w - x, 0.0) for w, x in zip(windows, wait, strict=True)]
    return StepTiming(step=step, compute=compute, wait=wait)


class _Clock:
    """Marks on the host clock, or on the device's stream (CUDA events, resolved lazily)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def settle(self, mark: Any) -> None:
        if self.cuda:
            mark.synchronize()


class StragglerMonitor:
    """This rank's marks and, every ``straggler_interval`` steps, the collective verdict.

    Every rank calls the same methods at the same steps (`measure` is collective). Rank 0
    prints one line when a straggler starts and one when it ends.
    """

    def __init__(self, config: FaultsConfig, *, rank: int, world_size: int,
                 device: torch.device, is_main: bool) -> None:
        self.interval = config.straggler_interval
        self.factor = config.straggler_factor
        self.steps = config.straggler_steps
        self.enabled = self.interval > 0 and world_size > 1 and dist.is_available() \
            and dist.is_initialized()
        self.rank, self.world_size, self.is_main = rank, world_size, is_main
        self.clock = _Clock(device)
        self.comm_device = device if dist.is_initialized() and \
            dist.get_backend() == "nccl" else torch.device("cpu")
        self.hosts: list[str] = []
        self.active: dict[int, Straggler] = {}
        self.named: list[Straggler] = []
        """Every straggler named in this process, in order (the summary's ``stragglers``)."""
        self.streaks: dict[int, tuple[int, float]] = {}
        """rank → (first slow step of its current streak, latest factor)."""
        self._counts: dict[int, int] = {}
        """rank → measured steps in a row it was slow."""
        self.wait_s = 0.0
        """Seconds lost to waiting in collectives, averaged over ranks, over measured steps."""
        self.history: list[StepTiming] = []
        self._prev_end: Any = None
        self._block: Any = None
        self._checks: list[tuple[Any, Any]] = []
        self._check_start: Any = None
        self._open = False
        """Inside a bracketed blocking part (nested blocking points are not counted twice)."""
        self._rows: list[tuple[int, Any, Any, Any, list[tuple[Any, Any]]]] = []
        self._last_end: Any = None

    def attach(self, model: Any, dims: Any) -> None:
        """Under plain DDP (only ``dp_replicate`` > 1) the ranks first meet in the gradient
        all-reduce of the last backward: mark there. Any other layout gathers or exchanges in
        the forward, so the step's start is the mark."""
        global _ACTIVE
        if self.enabled:
            _ACTIVE = weakref.ref(self)
        if self.enabled and dims is not None and dims.dp_shard == dims.tp == dims.cp == \
                dims.pp == 1 and not model.is_pipelined:
            model.before_reduction = self.reduction_started

    def summary(self) -> dict[str, Any]:
        """``collective_wait_s`` (this run's measured steps, mean over ranks) and every
        straggler named (with its latest factor)."""
        return {"collective_wait_s": self.wait_s,
                "stragglers": [s.as_dict() for s in self.named]}

    # ------------------------------------------------------------------ marks (every step)
    def step_started(self) -> None:
        """The step starts (its forward may gather: the default start of its blocking part)."""
        if self.enabled:
            self._block = self.clock.mark()
            self._open = True

    def reduction_started(self) -> None:
        """Plain DDP: the last backward, whose gradient all-reduce the ranks meet in, starts."""
        if self.enabled:
            self._block = self.clock.mark()

    def step_ended(self, step: int) -> None:
        """Step ``step``'s update is done: closes its window."""
        if not self.enabled:
            return
        end = self.clock.mark()
        if self._prev_end is not None and self._block is not None:
            self._rows.append((step, self._prev_end, self._block, end, self._checks))
        self._prev_end, self._block, self._checks, self._last_end = end, None, [], end
        self._open = False

    def checks_started(self) -> None:
        """The fault checks (the loss all-reduce, this monitor's all-gather) start."""
        if self.enabled:
            self._check_start = self.clock.mark()
            self._open = True

    def checks_ended(self) -> None:
        """The fault checks are done: their time is blocked time of the next window."""
        if self.enabled and self._check_start is not None:
            self._checks.append((self._check_start, self.clock.mark()))
            self._check_start = None
            self._open = False

    def restart(self) -> None:
        """After a rollback the next window would span the reload: it is not measured."""
        self._prev_end, self._block, self._checks = None, None, []

    # ------------------------------------------------------------------ the verdict
    def measure(self, step: int) -> list[StepTiming]:
        """Every ``straggler_interval`` steps: all-gather the windows measured since the last
        time and update the stragglers. Collective; returns the steps measured (else [])."""
        if not self.enabled or step % self.interval != 0:
            return []
        if not self.hosts:
            self.hosts = [""] * self.world_size
            dist.all_gather_object(self.hosts, socket.gethostname())
        if self._last_end is not None:
            self.clock.settle(self._last_end)
        rows = self._rows[-self.interval:]
        self._rows = []
        values = [[-1.0, -1.0, -1.0]] * self.interval
        for i, (at, prev_end, block, end, checks) in enumerate(rows):
            blocked = self.clock.seconds(block, end) + sum(
                self.clock.seconds(a, b) for a, b in checks)
            values[i] = [float(at), self.clock.seconds(prev_end, end), blocked]
        payload = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        gathered = [torch.empty_like(payload) for _ in range(self.world_size)]
        dist.all_gather(gathered, payload)
        table = torch.stack(gathered).tolist()  # [rank][row][step, window, blocked]
        timings = []
        for i in range(self.interval):
            if any(table[r][i][0] < 0 for r in range(self.world_size)):
                continue  # a row some rank did not measure (the first step, a rollback)
            timing = split_waiting(int(table[0][i][0]), [t[i][1] for t in table],
                                   [t[i][2] for t in table])
            self._observe(timing)
            timings.append(timing)
        self.history.extend(timings)
        return timings

    def _observe(self, timing: StepTiming) -> None:
        self.wait_s += sum(timing.wait) / len(timing.wait)
        for rank, factor in enumerate(timing.factors()):
            if factor >= self.factor:
                since, _ = self.streaks.get(rank, (timing.step, factor))
                self.streaks[rank] = (since, factor)
                if rank in self.active:
                    self.active[rank].factor = factor
                elif self._counts.get(rank, 0) + 1 >= self.steps:
                    self.active[rank] = Straggler(rank=rank, host=self.hosts[rank],
                                                  factor=factor, since_step=since)
                    self.named.append(self.active[rank])
                    self._say(f"straggler: rank {rank} (host {self.hosts[rank]}) computes "
                              f"{factor:.2f}x the median rank's step time since step {since}; "
                              f"the other ranks wait for it (faults.straggler_factor="
                              f"{self.factor:g}, {self.steps} measured steps in a row)")
                self._counts[rank] = self._counts.get(rank, 0) + 1
            else:
                self.streaks.pop(rank, None)
                self._counts.pop(rank, None)
                ended = self.active.pop(rank, None)
                if ended is not None:
                    self._say(f"straggler: rank {rank} (host {ended.host}) caught up at step "
                              f"{timing.step} (slow since step {ended.since_step})")

    def _say(self, text: str) -> None:
        if self.is_main:
            print(text, file=sys.stderr, flush=True)

    def current(self) -> list[dict[str, Any]]:
        """The stragglers named now (for metrics.jsonl and the goodput ledger)."""
        return [s.as_dict() for _, s in sorted(self.active.items())]
