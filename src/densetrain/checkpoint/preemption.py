"""SIGTERM / SIGINT (what schedulers send before preemption) become "save, then exit cleanly".

`PreemptionHandler` installs handlers that only set a flag; the loop asks `should_stop()` after
each step (a vote over all ranks: a signal reaches the ranks at slightly different times, and
every rank must stop after the same step), saves a checkpoint and returns. From the first
signal a watchdog gives the save ``grace_s`` seconds; past it the process exits with
``128 + signal`` anyway (the previous checkpoint is intact: saves are atomic). A second signal
exits at once. The exit code of a preempted run is ``128 + signal`` (143 for SIGTERM, 130 for
SIGINT) so that schedulers and restart loops see an unfinished run.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from densetrain.checkpoint import collective
from densetrain.errors import UserError

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Turns the first SIGTERM/SIGINT into a stop request; a context manager (install/restore).

    The stop vote runs on the default group when it is gloo, else on a gloo group of its own
    (made on `install`, collective; ``timeout_s`` bounds its collectives).
    """

    def __init__(self, *, grace_s: float, timeout_s: float = 600.0,
                 signals: tuple[signal.Signals, ...] = HANDLED_SIGNALS) -> None:
        if not grace_s > 0:
            raise UserError(f"checkpoint.preemption_grace_s must be > 0, got {grace_s}")
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.group: Any = None
        self.signals = signals
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        """True once this process received one of the signals."""
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        """Name of the signal received (empty when none)."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` once a signal arrived, else 0."""
        return 128 + self.signum if self.signum is not None else 0

    def install(self) -> None:
        """Install the handlers (only possible in the main thread; elsewhere a no-op)."""
        if collective.dist_on():
            import torch.distributed as dist

            if dist.get_backend() != "gloo":
                self.group = collective.new_cpu_group(self.timeout_s)
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Restore the previous handlers and stop the watchdog."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def __enter__(self) -> PreemptionHandler:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"second {name}: exiting now without waiting for the checkpoint",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        print(f"received {name}: saving a checkpoint after this step, then exiting (grace "
              f"{self.grace_s:g} s)", file=sys.stderr, flush=True)
        self._watchdog = threading.Timer(self.grace_s, self._grace_expired)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _grace_expired(self) -> None:
        print(f"the checkpoint did not finish within checkpoint.preemption_grace_s="
              f"{self.grace_s:g} s of {self.signal_name}; exiting (the previous checkpoint is "
              "intact)", file=sys.stderr, flush=True)
        os._exit(self.exit_code)

    def should_stop(self) -> bool:
        """True on every rank when any rank received a signal (collective when distributed)."""
        if not collective.dist_on():
            return self.requested
        import torch
        import torch.distributed as dist

        vote = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        if self.signum is None and int(vote) != 0:
            self.signum = int(vote)  # a peer was signalled: stop with its signal
        return int(vote) != 0
