"""Where the loop's iteration is: one tracker that tells the hang watchdog and the goodput
ledger, so that `RunLoop` marks each phase once."""

from __future__ import annotations

from densetrain.train.goodput import GoodputLedger
from densetrain.train.watchdog import HangWatchdog

_BUCKET_OF_PHASE = {"data": "data", "fault checks": "checks", "evaluation": "evaluation",
                    "callbacks": "callbacks", "startup": "startup"}


class PhaseTracker:
    """Phases of an iteration: ``data`` → ``step`` → ``fault checks`` → ``evaluation`` →
    ``callbacks``. Either part may be absent."""

    def __init__(self, watchdog: HangWatchdog | None, ledger: GoodputLedger | None) -> None:
        self.watchdog = watchdog
        self.ledger = ledger
        self.phase = "startup"
        self.step = 0

    def _close_phase(self) -> None:
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
