"""Loss-spike detector: the step's loss against the running median and MAD of recent steps.

A robust statistic because the losses of a window are not normal: a median and the median
absolute deviation (MAD) ignore the few outliers a plain mean and standard deviation would
follow, so one spike does not hide the next. ``1.4826 × MAD`` estimates the standard deviation
of normally distributed values (Rousseeuw & Croux, 1993), so ``threshold`` reads as "sigmas".
SciPy's ``median_abs_deviation`` computes the same figure; the window is a few hundred floats,
so NumPy's median is all it needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826
"""Scale that makes the MAD of normal data an estimate of its standard deviation."""


@dataclass(kw_only=True, frozen=True)
class Spike:
    """A loss that left the window's robust band."""

    step: int
    loss: float
    median: float
    deviation: float
    """The robust deviation (1.4826 × MAD, floored) the threshold multiplied."""

    @property
    def sigmas(self) -> float:
        """How many robust deviations above the median the loss lies."""
        return (self.loss - self.median) / self.deviation


class SpikeDetector:
    """Flags a step whose loss exceeds ``median + threshold × deviation`` of the last ``window``
    losses, once ``min_history`` losses are in the window and from step ``warmup_steps`` on.
    ``deviation = max(1.4826 × MAD, min_deviation × median)``. A flagged loss is not added to
    the window (it would drag the band up); `forget_after` drops the losses of steps undone by
    a rollback."""

    def __init__(self, *, window: int, threshold: float, min_deviation: float,
                 warmup_steps: int, min_history: int) -> None:
        self.threshold = threshold
        self.min_deviation = min_deviation
        self.warmup_steps = warmup_steps
        self.min_history = min_history
        self.history: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, step: int, loss: float) -> Spike | None:
        """Check ``loss`` of ``step``; returns the `Spike` or None (then the loss joins the
        window)."""
        if step >= self.warmup_steps and len(self.history) >= self.min_history:
            values = np.fromiter((v for _, v in self.history), dtype=np.float64)
            median = float(np.median(values))
            mad = float(np.median(np.abs(values - median)))
            deviation = max(MAD_TO_SIGMA * mad, self.min_deviation * abs(median), 1e-12)
            if loss > median + self.threshold * deviation:
                return Spike(step=step, loss=loss, median=median, deviation=deviation)
        self.history.append((step, loss))
        return None

    def forget_after(self, step: int) -> None:
        """Drop the losses of steps after ``step`` (undone by a rollback to ``step``)."""
        kept = [(s, v) for s, v in self.history if s <= step]
        self.history.clear()
        self.history.extend(kept)
