"""Hang watchdog: a per-rank thread that notices an iteration of the loop taking far longer
than the recent ones, dumps every thread's Python stack and ends the process naming the rank
and the step, well before the collective timeout would.

A hung collective blocks the main thread inside C++ (gloo, NCCL), where no Python exception can
reach it, so the watchdog's own thread reports and exits the process (``os._exit``) with
`HANG_EXIT_CODE`; the launcher (torchrun) then stops the other ranks. Every rank runs one: the
rank that stalled shows where in its stack, the ranks waiting for it show the collective.
``faulthandler`` writes the stacks (the standard library's dump of every thread; a blocking
collective has released the GIL, so the watchdog thread runs). In a multi-rank job the message
names the rank that stopped or is stuck, from the ranks' heartbeats
(`densetrain.parallel.heartbeat`; watching them adds a few seconds before the exit).
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from densetrain.config.sections import FaultsConfig

HANG_EXIT_CODE = 75
"""Exit status of a process the watchdog ended."""


def start_watchdog(config: FaultsConfig, *, rank: int, run_dir: Path) -> HangWatchdog | None:
    """The job's watchdog (None when ``faults.hang_watchdog`` is off)."""
    if not config.hang_watchdog:
        return None
    return HangWatchdog(rank=rank, run_dir=run_dir, factor=config.hang_factor,
                        min_seconds=config.hang_min_seconds,
                        first_step_seconds=config.hang_first_steps_seconds)


class HangWatchdog:
    """Watches the loop's iterations (``begin(step)`` … ``end()``) from a daemon thread.

    An iteration is a hang when it has run longer than ``max(min_seconds, factor × median of
    the last `window` iterations)``; before ``min_history`` iterations are timed (the first
    steps compile and warm up) only ``first_step_seconds`` applies. On a hang: the message and
    every thread's stack go to stderr and ``<run_dir>/watchdog-rank<r>.log``, then the process
    exits with `HANG_EXIT_CODE`.
    """

    def __init__(self, *, rank: int, run_dir: Path, factor: float, min_seconds: float,
                 first_step_seconds: float, window: int = 50, min_history: int = 5) -> None:
        self.rank = rank
        self.log_path = Path(run_dir) / f"watchdog-rank{rank}.log"
        self.factor = factor
        self.min_seconds = min_seconds
        self.first_step_seconds = first_step_seconds
        self.min_history = min_history
        self.durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._step = 0
        self._phase = ""
        self._started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hang-watchdog-rank{rank}",
                                        daemon=True)
        self._thread.start()

    def limit(self) -> float:
        """Seconds an iteration may take now."""
        if len(self.durations) < self.min_history:
            return max(self.first_step_seconds, self.min_seconds)
        return max(self.min_seconds, self.factor * statistics.median(self.durations))

    def begin(self, step: int, phase: str = "step") -> None:
        """An iteration for ``step`` (1-based, the step being taken) starts."""
        with self._lock:
            self._step, self._phase, self._started = step, phase, time.monotonic()

    def phase(self, phase: str) -> None:
        """Name what the iteration does now (shown in the message)."""
        with self._lock:
            self._phase = phase

    def end(self) -> None:
        """The iteration finished; its duration joins the window."""
        with self._lock:
            if self._started is not None:
                self.durations.append(time.monotonic() - self._started)
            self._started = None

    def pause(self) -> None:
        """Stop watching until the next `begin` (after the loop, during rollbacks)."""
        with self._lock:
            self._started = None

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = max(0.05, min(1.0, self.min_seconds / 10))
        while not self._stop.wait(poll):
            with self._lock:
                started, step, phase = self._started, self._step, self._phase
            if started is None:
                continue
            elapsed, limit = time.monotonic() - started, self.limit()
            if elapsed > limit:
                self._report(step, phase, elapsed, limit)

    def _report(self, step: int, phase: str, elapsed: float, limit: float) -> None:
        median = statistics.median(self.durations) if self.durations else float("nan")
        message = (
            f"hang watchdog: rank {self.rank} has spent {elapsed:.1f} s in step {step} "
            f"({phase}), more than its limit of {limit:.1f} s (faults.hang_factor={self.factor}"
            f" × the recent median {median:.3f} s, at least faults.hang_min_seconds="
            f"{self.min_seconds}); {_who_stalled()}. Every thread's Python stack follows; "
            f"the process exits with status {HANG_EXIT_CODE}."
        )
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "w", encoding="utf-8") as log:
                log.write(message + "\n")
                log.flush()
                faulthandler.dump_traceback(file=log, all_threads=True)
        finally:
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)


def _who_stalled() -> str:
    """The rank(s) that stopped or are stuck, as the heartbeats tell (this process's own
    heartbeat, when a multi-rank job runs one)."""
    from densetrain.parallel.heartbeat import current_heartbeat

    beat = current_heartbeat()
    if beat is None:
        return "a rank stalled or a collective waits for one"
    try:
        return f"heartbeats: {beat.explain()}"
    except Exception as err:  # the watchdog must exit whatever the heartbeats hold
        return f"a rank stalled or a collective waits for one (heartbeats unreadable: {err})"
