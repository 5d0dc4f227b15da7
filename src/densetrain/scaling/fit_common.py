"""Shared pieces of the scaling fits: the error type, estimates with intervals, log-log fits,
and a percentile bootstrap."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from densetrain.scaling.optimal import PowerLaw


class FitError(RuntimeError):
    """A fit that cannot be made from the given data or that did not converge."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A fitted value with an optional bootstrap percentile interval [low, high]."""

    value: float
    low: float | None = None
    high: float | None = None

    def __str__(self) -> str:
        if self.low is None or self.high is None:
            return f"{self.value:.4g}"
        return f"{self.value:.4g} [{self.low:.4g}, {self.high:.4g}]"

    def as_dict(self) -> dict[str, float | None]:
        """JSON-friendly form."""
        return {"value": self.value, "low": self.low, "high": self.high}


def require_points(count: int, minimum: int, what: str) -> None:
    """Raise ``FitError`` when fewer than ``minimum`` points are available for ``what``."""
    if count < minimum:
        raise FitError(f"{what} needs at least {minimum} points, got {count}")


def fit_loglog(x: np.ndarray, y: np.ndarray, *, what: str) -> PowerLaw:
    """Least-squares line through (log x, log y): y = k·x^a. Needs two distinct x values."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    require_points(len(np.unique(x)), 2, f"{what} (distinct x values)")
    if np.any(x <= 0) or np.any(y <= 0):
        raise FitError(f"{what}: a power law needs positive values")
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    if not (math.isfinite(slope) and math.isfinite(intercept)):
        raise FitError(f"{what}: the log-log least-squares fit did not converge")
    return PowerLaw(coefficient=float(math.exp(intercept)), exponent=float(slope))


def group_by_relative_value(values: np.ndarray, *, rel_tol: float = 0.02) -> np.ndarray:
    """Labels 0..k-1 grouping sorted ``values`` whose neighbours differ by under ``rel_tol``."""
    values = np.asarray(values, dtype=float)
    order = np.argsort(values)
    labels = np.empty(len(values), dtype=int)
    label = 0
    for rank, idx in enumerate(order):
        if rank > 0 and values[idx] > values[order[rank - 1]] * (1 + rel_tol):
            label += 1
        labels[idx] = label
    return labels


def bootstrap(
    fit_once: Callable[[np.random.Generator], dict[str, float]],
    *,
    num_resamples: int,
    seed: int,
) -> tuple[dict[str, np.ndarray], int]:
    """Run ``fit_once(rng)`` (which resamples and refits) ``num_resamples`` times.

    Returns the collected values per key and the number of resamples whose fit failed
    (``FitError``); failed resamples are left out of the intervals and reported. When more
    than half fail, no values are returned (an interval from the few that fit would mislead).
    """
    rng = np.random.default_rng(seed)
    collected: dict[str, list[float]] = {}
    failures = 0
    for _ in range(num_resamples):
        try:
            values = fit_once(rng)
        except FitError:
            failures += 1
            continue
        for key, value in values.items():
            collected.setdefault(key, []).append(value)
    if failures * 2 > num_resamples:
        return {}, failures
    return {k: np.asarray(v) for k, v in collected.items()}, failures


def with_intervals(
    point: dict[str, float], samples: dict[str, np.ndarray], *, level: float = 0.95
) -> dict[str, Estimate]:
    """Attach percentile intervals at ``level`` to each point estimate (no samples: no interval)."""
    tail = (1.0 - level) / 2.0 * 100.0
    out: dict[str, Estimate] = {}
    for key, value in point.items():
        draws = samples.get(key)
        if draws is None or len(draws) < 2:
            out[key] = Estimate(value=float(value))
            continue
        low, high = np.percentile(draws, [tail, 100.0 - tail])
        out[key] = Estimate(value=float(value), low=float(low), high=float(high))
    return out


_OPENBLAS_THREAD_FUNCTIONS = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
)


def _loaded_openblas() -> list[tuple[Callable[[], int], Callable[[int], None]]]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:  # not Linux: leave the thread count alone
        return []
    handles = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _OPENBLAS_THREAD_FUNCTIONS:
            if hasattr(lib, get_name) and hasattr(lib, set_name):
                handles.append((getattr(lib, get_name), getattr(lib, set_name)))
                break
    return handles


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Run the block with OpenBLAS limited to one thread, then restore the previous count.

    SciPy's L-BFGS-B and least squares call BLAS/LAPACK on 5x5 problems thousands of times;
    with OpenBLAS threads on a busy machine each call waits on thread hand-offs (measured: 10 ms
    per L-BFGS iteration instead of 0.3 ms). threadpoolctl does this in general but is not a
    dependency, so the OpenBLAS thread setters are called directly through ctypes.
    """
    handles = _loaded_openblas()
    previous = [get() for get, _ in handles]
    for _, set_threads in handles:
        set_threads(1)
    try:
        yield
    finally:
        for (_, set_threads), count in zip(handles, previous, strict=True):
            set_threads(count)


def blas_single_threaded(func: Callable) -> Callable:
    """Decorator form of ``single_threaded_blas``."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with single_threaded_blas():
            return func(*args, **kwargs)

    return wrapper
