"""Where the loop's iteration is: one tracker that tells the hang watchdog and the goodput
ledger, so that `RunLoop` marks each phase once."""

from __future__ import annotations

from typing import Any

from densetrain.train.goodput import GoodputLedger
from densetrain.train.stragglers import StragglerMonitor
from densetrain.train.watchdog import HangWatchdog

_BUCKET_OF_PHASE = {"data": "data", "fault checks": "checks", "evaluation": "evaluation",
                    "callbacks": "callbacks", "startup": "startup"}


class PhaseTracker:
    """Phases of an iteration: ``data`` → ``step`` → ``fault checks`` → ``evaluation`` →
    ``callbacks``. Either part may be absent."""

    def __init__(self, watchdog: HangWatchdog | None, ledger: GoodputLedger | None,
                 stragglers: StragglerMonitor | None = None) -> None:
        self.watchdog = watchdog
        self.ledger = ledger
        self.stragglers = stragglers
        self.phase = "startup"
        self.step = 0

    def _close_phase(self) -> None:
        if self.stragglers is not None:
            if self.phase == "step":
                self.stragglers.step_ended(self.step)
            elif self.phase == "fault checks":
                self.stragglers.checks_ended()
        if self.ledger is None:
            return
        if self.phase == "step":
            self.ledger.mark(self.ledger.step_bucket(self.step))
        else:
            self.ledger.mark(_BUCKET_OF_PHASE[self.phase])

    def begin(self, step: int) -> None:
        """An iteration taking step ``step`` (1-based) starts with reading its batch."""
        self._close_phase()
        if self.ledger is not None and self.phase == "startup":
            self.ledger.flush(step - 1)
        self.phase, self.step = "data", step
        if self.watchdog is not None:
            self.watchdog.begin(step, "data")

    def enter(self, phase: str) -> None:
        """The iteration moves on to ``phase``."""
        self._close_phase()
        self.phase = phase
        if self.stragglers is not None:
            if phase == "step":
                self.stragglers.step_started()
            elif phase == "fault checks":
                self.stragglers.checks_started()
        if self.watchdog is not None:
            self.watchdog.phase(phase)

    def end(self) -> None:
        """The iteration finished (its ledger line is written)."""
        self._close_phase()
        self.phase = "callbacks"  # nothing is left open; the next begin() marks ~0 s
        if self.ledger is not None:
            self.ledger.flush(self.step)
        if self.watchdog is not None:
            self.watchdog.end()

    def measure_stragglers(self, step: int) -> list[dict[str, Any]]:
        """In the fault checks: every ``faults.straggler_interval`` steps the ranks' timings
        are all-gathered (collective) and the goodput line notes the time lost to waiting;
        returns the stragglers named now."""
        if self.stragglers is None:
            return []
        timings = self.stragglers.measure(step)
        if timings and self.ledger is not None:
            self.ledger.note_waiting(sum(sum(t.wait) / len(t.wait) for t in timings),
                                     self.stragglers.current())
        return self.stragglers.current()

    def rolled_back(self) -> None:
        """A rollback reloaded the state: the next step's window is not measured."""
        if self.stragglers is not None:
            self.stragglers.restart()

    def stop(self) -> None:
        """After the loop: the closing work is not watched (the ledger keeps counting it as
        callbacks until `finish`)."""
        if self.watchdog is not None:
            self.watchdog.pause()

    def finish(self, step: int) -> None:
        """The end of the run: account the closing work."""
        if self.ledger is not None:
            self.ledger.mark("callbacks")
            self.ledger.flush(step)
