"""Callbacks the tests use to disturb a run for real."""

from __future__ import annotations

from densetrain.train import Callback


class InterruptAfter(Callback):
    """Raises ``KeyboardInterrupt`` after step ``at`` (after the default callbacks saved that
    step's checkpoint), as a Ctrl-C between steps would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at:
            raise KeyboardInterrupt(f"interrupted after step {self.at}")
