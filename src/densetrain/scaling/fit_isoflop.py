"""Chinchilla approaches 1 and 2 (Hoffmann et al. 2022, §3.1 and §3.2).

Approach 2 (IsoFLOP profiles): for each FLOP budget, a parabola of final loss in log N; its vertex
is that budget's N_opt (and D_opt = C / (6·N_opt)); power laws N_opt ∝ C^a and D_opt ∝ C^b go
through the vertices. Budgets are the ``budget`` column when present, else ``flops`` grouped
within 2%.

Approach 1 (envelope of training curves): each run's loss curve is put on a FLOP axis
(C = 6·N·tokens); on a log-spaced grid of C, the run with the lowest interpolated loss gives
N_opt(C) and D_opt(C) = C/(6·N_opt); power laws go through those points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from densetrain.errors import UserError
from densetrain.scaling.fit_common import (
    Estimate,
    FitError,
    bootstrap,
    fit_loglog,
    group_by_relative_value,
    require_points,
    with_intervals,
)
from densetrain.scaling.optimal import PowerLaw
from densetrain.scaling.results import ResultsTable


@dataclass(frozen=True, kw_only=True)
class IsoFlopProfile:
    """One budget's runs and the parabola loss = c2·x² + c1·x + c0 in x = ln N."""

    budget: float
    params: np.ndarray
    loss: np.ndarray
    coefficients: tuple[float, float, float]
    n_opt: float
    loss_opt: float

    @property
    def minimum_inside(self) -> bool:
        """Whether the vertex lies within the sampled N range (not extrapolated)."""
        return bool(self.params.min() <= self.n_opt <= self.params.max())

    def predict(self, params: np.ndarray) -> np.ndarray:
        """The parabola at ``params``."""
        x = np.log(np.asarray(params, dtype=float))
        c2, c1, c0 = self.coefficients
        return c2 * x**2 + c1 * x + c0


@dataclass(frozen=True, kw_only=True)
class FrontierFit:
    """Power laws N_opt = k_N·C^a and D_opt = k_D·C^b through per-budget optima."""

    approach: str
    n_law: PowerLaw
    d_law: PowerLaw
    estimates: dict[str, Estimate]
    flops: np.ndarray
    n_opt: np.ndarray
    d_opt: np.ndarray
    profiles: tuple[IsoFlopProfile, ...] = ()
    bootstrap_failures: int = 0
    without_minimum: dict[float, str] = field(default_factory=dict)


def budgets_of(table: ResultsTable) -> np.ndarray:
    """Each run's FLOP budget: the ``budget`` column, else ``flops`` grouped within 2%."""
    if table.has_column("budget"):
        return table.column("budget")
    labels = group_by_relative_value(table.flops)
    means = {lab: float(np.exp(np.log(table.flops[labels == lab]).mean())) for lab in set(labels)}
    return np.array([means[lab] for lab in labels])


def fit_profile(budget: float, params: np.ndarray, loss: np.ndarray) -> IsoFlopProfile:
    """Fit one IsoFLOP parabola; ``FitError`` when it has no minimum (curvature <= 0)."""
    require_points(len(np.unique(params)), 3, f"IsoFLOP profile at C={budget:.3g} (distinct N)")
    c2, c1, c0 = np.polyfit(np.log(params), loss, 2)
    if not c2 > 0:
        raise FitError(
            f"IsoFLOP profile at C={budget:.3g}: the parabola in log N opens downwards "
            f"(curvature {c2:.3g}), so this budget shows no minimum; widen its N range"
        )
    x_opt = -c1 / (2 * c2)
    return IsoFlopProfile(
        budget=float(budget), params=np.asarray(params), loss=np.asarray(loss),
        coefficients=(float(c2), float(c1), float(c0)), n_opt=float(math.exp(x_opt)),
        loss_opt=float(c0 - c1**2 / (4 * c2)),
    )


def _window(params: np.ndarray, loss: np.ndarray, window: int | None) -> np.ndarray:
    """Indices of the ``window`` runs nearest (in log N) to the lowest-loss run; all if None."""
    if window is None or window >= len(params):
        return np.arange(len(params))
    distance = np.abs(np.log(params) - np.log(params[np.argmin(loss)]))
    return np.sort(np.argsort(distance, kind="stable")[:window])


def _isoflop_point(table: ResultsTable, budgets: np.ndarray, *, skip_without_minimum: bool,
                   window: int | None = None) -> tuple[dict, tuple]:
    profiles, without_minimum = [], {}
    for budget in np.unique(budgets):
        members = np.flatnonzero(budgets == budget)
        members = members[_window(table.params[members], table.loss[members], window)]
        try:
            profiles.append(fit_profile(budget, table.params[members], table.loss[members]))
        except FitError as err:
            if not skip_without_minimum:
                raise
            without_minimum[float(budget)] = str(err)
    if len(profiles) < 2:
        reasons = "; ".join(without_minimum.values())
        raise FitError(
            f"Chinchilla approach 2 needs at least 2 budgets with a minimum, got {len(profiles)}"
            + (f" ({reasons})" if reasons else "")
        )
    flops = np.array([p.budget for p in profiles])
    n_opt = np.array([p.n_opt for p in profiles])
    d_opt = flops / (6.0 * n_opt)
    n_law = fit_loglog(flops, n_opt, what="approach 2 N_opt(C)")
    d_law = fit_loglog(flops, d_opt, what="approach 2 D_opt(C)")
    point = {"a": n_law.exponent, "b": d_law.exponent, "k_n": n_law.coefficient,
             "k_d": d_law.coefficient}
    return point, (n_law, d_law, flops, n_opt, d_opt, tuple(profiles), without_minimum)


def fit_isoflop(table: ResultsTable, *, num_resamples: int = 0, seed: int = 0,
                window: int | None = None) -> FrontierFit:
    """Chinchilla approach 2 with bootstrap intervals (runs resampled within each budget).

    ``window``: fit each parabola to the ``window`` runs nearest (in log N) to the budget's
    lowest loss instead of all of them; a parabola describes a profile only near its minimum,
    and wide sweeps rise much more steeply on one side.

    A budget whose parabola has no minimum is left out and listed in ``without_minimum`` with
    the reason (the report prints it); fewer than two budgets with a minimum is a ``FitError``.
    Bootstrap resamples use the budgets of the point fit and fail when one loses its minimum.
    """
    budgets = budgets_of(table)
    if window is not None and window < 3:
        raise UserError(f"window must be >= 3 runs (a parabola has 3 coefficients), got {window}")
    point, (n_law, d_law, flops, n_opt, d_opt, profiles, without) = _isoflop_point(
        table, budgets, skip_without_minimum=True, window=window)
    groups = [np.flatnonzero(budgets == b) for b in flops]

    def once(rng: np.random.Generator) -> dict[str, float]:
        idx = np.concatenate([rng.choice(g, size=len(g), replace=True) for g in groups])
        return _isoflop_point(table.subset(idx), budgets[idx], skip_without_minimum=False,
                              window=window)[0]

    samples, failures = bootstrap(once, num_resamples=num_resamples, seed=seed)
    return FrontierFit(
        approach="isoflop", n_law=n_law, d_law=d_law, estimates=with_intervals(point, samples),
        flops=flops, n_opt=n_opt, d_opt=d_opt, profiles=profiles, bootstrap_failures=failures,
        without_minimum=without,
    )


@dataclass(frozen=True, kw_only=True)
class LossCurve:
    """A run's training curve: ``tokens`` seen and ``loss`` at each logged step, model size N."""

    params: float
    tokens: np.ndarray
    loss: np.ndarray


def envelope_points(curves: Sequence[LossCurve], *, num_points: int = 40
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C grid, N_opt, min loss) of the lower envelope of ``curves`` on a log-spaced C grid.

    Only grid points covered by at least two curves are kept, so that a minimum is a choice.
    """
    spans = [(6.0 * c.params * c.tokens.min(), 6.0 * c.params * c.tokens.max()) for c in curves]
    low = min(s[0] for s in spans)
    high = max(s[1] for s in spans)
    grid = np.geomspace(low, high, num_points)
    flops, n_opt, best_loss = [], [], []
    for c_value in grid:
        candidates = []
        for curve, (lo, hi) in zip(curves, spans, strict=True):
            if lo <= c_value <= hi:
                log_c = np.log(6.0 * curve.params * curve.tokens)
                candidates.append((float(np.interp(np.log(c_value), log_c, curve.loss)),
                                   curve.params))
        if len(candidates) >= 2:
            loss_value, params = min(candidates)
            flops.append(c_value)
            n_opt.append(params)
            best_loss.append(loss_value)
    return np.array(flops), np.array(n_opt), np.array(best_loss)


def _envelope_point(curves: Sequence[LossCurve], num_points: int) -> tuple[dict, tuple]:
    flops, n_opt, _ = envelope_points(curves, num_points=num_points)
    require_points(len(flops), 3, "Chinchilla approach 1 (envelope points)")
    d_opt = flops / (6.0 * n_opt)
    n_law = fit_loglog(flops, n_opt, what="approach 1 N_opt(C)")
    d_law = fit_loglog(flops, d_opt, what="approach 1 D_opt(C)")
    point = {"a": n_law.exponent, "b": d_law.exponent, "k_n": n_law.coefficient,
             "k_d": d_law.coefficient}
    return point, (n_law, d_law, flops, n_opt, d_opt)


def fit_envelope(curves: Sequence[LossCurve], *, num_points: int = 40, num_resamples: int = 0,
                 seed: int = 0) -> FrontierFit:
    """Chinchilla approach 1 with bootstrap intervals (curves resampled with replacement)."""
    require_points(len({c.params for c in curves}), 2, "Chinchilla approach 1 (model sizes)")
    point, (n_law, d_law, flops, n_opt, d_opt) = _envelope_point(curves, num_points)

    def once(rng: np.random.Generator) -> dict[str, float]:
        idx = rng.integers(0, len(curves), len(curves))
        return _envelope_point([curves[i] for i in idx], num_points)[0]

    samples, failures = bootstrap(once, num_resamples=num_resamples, seed=seed)
    return FrontierFit(
        approach="envelope", n_law=n_law, d_law=d_law, estimates=with_intervals(point, samples),
        flops=flops, n_opt=n_opt, d_opt=d_opt, bootstrap_failures=failures,
    )
