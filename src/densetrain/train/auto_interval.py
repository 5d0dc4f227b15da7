"""`AutoInterval`: the measurements behind ``checkpoint.interval = "auto"`` (checkpoint/interval.py
holds the formula).

The Checkpointer asks `due(step)` after each step and reports each cadence save's stall (the
time its `on_step_end` blocked the loop: waiting for the previous background write, staging,
the synchronous part of the save) to `saved`. Every rank measures its own stall and step time;
`saved` (collective, at a step every rank saves) takes the largest of each over the ranks, so
all ranks compute the same interval from the same numbers (saves are collective: a rank that
chose another step would hang the others). The failure history is read by rank 0 and broadcast.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from typing import Any

from densetrain.checkpoint import collective
from densetrain.checkpoint.interval import (
    PROCESS_END,
    PROCESS_START,
    IntervalDecision,
    decide,
    failure_history,
    last_measured,
    prior_mtbf_hours,
    read_history_events,
)
from densetrain.checkpoint.resume import HISTORY_FILE, append_history

STEP_WINDOW = 50
"""Iterations whose median is the step time: recent enough to follow a change, and the median
ignores the odd evaluation or compilation step."""


class AutoInterval:
    """The interval of an ``auto`` run, re-decided after every cadence save."""

    def __init__(self, *, initial: int, minimum: int, device_mtbf_hours: float) -> None:
        self.initial = initial
        self.minimum = minimum
        self.device_mtbf_hours = device_mtbf_hours
        self.decision: IntervalDecision | None = None
        self.next_save = initial
        self._stalls: list[float] = []
        self._iterations: deque[float] = deque(maxlen=STEP_WINDOW)
        self._mark: float | None = None
        self._started = time.monotonic()
        self._failures, self._exposure_h, self._prior_h = 0, 0.0, 0.0
        self._run_dir: Any = None
        self._device: Any = None
        self._is_main = True

    def start(self, parts: Any, step: int) -> None:
        """Record this process's start, read the failure history and the stall and step time
        the previous process measured at this world size (collective). With those, the first
        interval is Young's at once, not ``auto_initial_interval`` (a fault soon after a
        restart then costs an interval's steps, not the initial interval's)."""
        self._run_dir, self._device, self._is_main = parts.run_dir, parts.device, parts.is_main
        append_history(parts.run_dir, {"event": PROCESS_START, "step": step,
                                       "world_size": parts.world_size})
        found: list[Any] = [None]
        if collective.rank() == 0:
            events = read_history_events(parts.run_dir / HISTORY_FILE)
            found[0] = (failure_history(events, time.time()), last_measured(events))
        if collective.dist_on():
            import torch.distributed as dist

            dist.broadcast_object_list(found, src=0)
        (self._failures, self._exposure_h), measured = found[0]
        stall, step_s = measured if measured is not None else (None, None)
        self._prior_h = prior_mtbf_hours(self.device_mtbf_hours, parts.world_size)
        self._started = time.monotonic()
        self._adopt(step, decide(stall_s=stall, step_s=step_s, prior_hours=self._prior_h,
                                 failures=self._failures, exposure_hours=self._exposure_h,
                                 initial=self.initial, minimum=self.minimum,
                                 carried=measured is not None))

    def end(self, outcome: str) -> None:
        """Record this process's clean end (``finished`` or ``preempted``)."""
        if self._run_dir is not None:
            append_history(self._run_dir, {"event": PROCESS_END, "outcome": outcome})

    def iteration_started(self) -> None:
        """Called when the Checkpointer's step hook begins: the time since the previous hook
        ended is one iteration (data, step, evaluation, other callbacks; no save stall)."""
        now = time.perf_counter()
        if self._mark is not None:
            self._iterations.append(now - self._mark)

    def iteration_ended(self) -> None:
        """Called when the Checkpointer's step hook ends."""
        self._mark = time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether ``step`` is a cadence save."""
        return step >= self.next_save

    def rolled_back(self, step: int) -> None:
        """The run went back to ``step``: the next save is one interval after it."""
        if self.decision is not None:
            self.next_save = step + self.decision.steps

    def saved(self, step: int, stall_s: float) -> None:
        """A cadence save at ``step`` stalled the loop ``stall_s`` seconds: decide again
        (collective)."""
        self._stalls.append(stall_s)
        values = [statistics.median(self._stalls),
                  statistics.median(self._iterations) if self._iterations else -1.0,
                  (time.monotonic() - self._started) / 3600.0]
        if collective.dist_on():  # the slowest rank's numbers, the same on every rank
            import torch
            import torch.distributed as dist

            tensor = torch.tensor(values, dtype=torch.float64, device=self._device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            values = tensor.tolist()
        stall, step_s, elapsed_h = values
        self._adopt(step, decide(stall_s=stall, step_s=step_s if step_s > 0 else None,
                                 prior_hours=self._prior_h, failures=self._failures,
                                 exposure_hours=self._exposure_h + elapsed_h,
                                 initial=self.initial, minimum=self.minimum))

    def _adopt(self, step: int, decision: IntervalDecision) -> None:
        """Use ``decision`` from ``step`` on; print and log it when the interval changes."""
        changed = self.decision is None or decision.steps != self.decision.steps
        self.decision = decision
        self.next_save = step + decision.steps
        if not changed:
            return
        if self._is_main:
            print(decision.describe(), file=sys.stderr, flush=True)
        append_history(self._run_dir, {"event": "checkpoint_interval", "step": step,
                                       **decision.record()})

    def summary(self) -> dict[str, Any]:
        """The interval in use at the end and what it was computed from."""
        return {"checkpoint_interval": self.decision.record() if self.decision else None}


def auto_interval(config: Any) -> AutoInterval | None:
    """The `AutoInterval` of a ``CheckpointConfig`` whose interval is ``"auto"``, else None."""
    if config.interval != "auto":
        return None
    return AutoInterval(initial=config.auto_initial_interval, minimum=config.auto_min_interval,
                        device_mtbf_hours=config.mtbf_prior_device_hours)
