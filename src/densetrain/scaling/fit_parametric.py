"""Chinchilla approach 3: fit L(N, D) = E + A/N^α + B/D^β as Hoffmann et al. 2022 Appendix D.2.

The objective is the Huber loss (δ = 1e-3) between the predicted and observed log loss,
    min over (a, b, e, α, β) of  Σ_i Huber_δ( LSE(a - α·log N_i, b - β·log D_i, e) - log L_i ),
with A = exp(a), B = exp(b), E = exp(e), minimised by L-BFGS from a grid of initialisations:
α, β ∈ {0, 0.5, ..., 2}, e ∈ {-1, -0.5, ..., 1}, a, b ∈ {0, 5, ..., 25} (4500 points).
The objective is evaluated on the whole grid at once and L-BFGS starts from the ``max_starts``
best grid points (``max_starts=None`` starts from all of them, as the paper does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import huber, logsumexp

from densetrain.scaling.fit_common import (
    Estimate,
    FitError,
    blas_single_threaded,
    bootstrap,
    require_points,
    with_intervals,
)
from densetrain.scaling.laws import ChinchillaLaw
from densetrain.scaling.optimal import chinchilla_optimal_laws
from densetrain.scaling.results import ResultsTable

HUBER_DELTA = 1e-3
# L-BFGS-B stops when the objective changes by < ftol relative to max(|f|, 1): the Huber objective
# of log losses is ~1e-4 in absolute terms, so it is minimised divided by delta**2 (same argmin),
# which puts it well above 1 and makes the relative tolerance meaningful.
_LBFGS_OPTIONS = {"maxiter": 3000, "ftol": 1e-13, "gtol": 1e-9, "maxcor": 20}


def default_grid() -> np.ndarray:
    """The paper's initialisation grid as rows (a, b, e, alpha, beta): shape [4500, 5]."""
    alphas = np.arange(0.0, 2.01, 0.5)
    es = np.arange(-1.0, 1.01, 0.5)
    abs_ = np.arange(0.0, 25.01, 5.0)
    mesh = np.meshgrid(abs_, abs_, es, alphas, alphas, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _predicted_log_loss(theta_K5: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """LSE of the three terms for each parameter row: shape [K, points]."""
    a, b, e, alpha, beta = (theta_K5[:, i : i + 1] for i in range(5))
    terms = np.stack(
        [a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(a), len(log_n)))], axis=0
    )
    return logsumexp(terms, axis=0)


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray,
                    log_loss: np.ndarray, delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """The Appendix D.2 objective and its gradient with respect to (a, b, e, α, β).

    Written out with NumPy rather than scipy.special's logsumexp/huber because L-BFGS calls it
    thousands of times per fit on a few dozen points, where their per-call overhead dominates.
    """
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    peak = terms.max(axis=0)
    exp_terms = np.exp(terms - peak)
    total = exp_terms.sum(axis=0)
    residual = peak + np.log(total) - log_loss
    weights = exp_terms / total
    abs_res = np.abs(residual)
    loss = np.where(abs_res <= delta, 0.5 * residual**2, delta * (abs_res - 0.5 * delta))
    psi = np.clip(residual, -delta, delta)  # derivative of the Huber loss
    w_psi = weights * psi
    grad = np.array([
        w_psi[0].sum(), w_psi[1].sum(), w_psi[2].sum(),
        -(w_psi[0] * log_n).sum(), -(w_psi[1] * log_d).sum(),
    ])
    return float(loss.sum()), grad


def _scaled_objective(theta, log_n, log_d, log_loss, delta) -> tuple[float, np.ndarray]:
    value, grad = huber_objective(theta, log_n, log_d, log_loss, delta)
    return value / delta**2, grad / delta**2


@dataclass(frozen=True, kw_only=True)
class ParametricFit:
    """Approach 3 result: the law, its objective, intervals and the compute-optimal exponents."""

    law: ChinchillaLaw
    objective: float
    estimates: dict[str, Estimate]
    converged_starts: int
    total_starts: int
    bootstrap_failures: int = 0


def _fit_point(log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray, *,
               starts: np.ndarray, delta: float) -> tuple[np.ndarray, float, int]:
    best_theta, best_value, converged = None, math.inf, 0
    for start in starts:
        res = minimize(_scaled_objective, start, args=(log_n, log_d, log_loss, delta),
                       jac=True, method="L-BFGS-B", options=_LBFGS_OPTIONS)
        if not (res.success and np.all(np.isfinite(res.x))):
            continue
        converged += 1
        if res.fun < best_value:
            best_theta, best_value = res.x, float(res.fun) * delta**2
    if best_theta is None:
        raise FitError(
            f"Chinchilla approach 3: L-BFGS did not converge from any of {len(starts)} starts"
        )
    return best_theta, best_value, converged


def _select_starts(grid: np.ndarray, log_n, log_d, log_loss, max_starts: int | None,
                   delta: float) -> np.ndarray:
    if max_starts is None or max_starts >= len(grid):
        return grid
    residual = _predicted_log_loss(grid, log_n, log_d) - log_loss[None, :]
    values = huber(delta, residual).sum(axis=1)
    return grid[np.argsort(values, kind="stable")[:max_starts]]


def _theta_to_law(theta: np.ndarray) -> ChinchillaLaw:
    a, b, e, alpha, beta = (float(v) for v in theta)
    if alpha <= 0 or beta <= 0:
        raise FitError(
            f"Chinchilla approach 3 converged to non-positive exponents (alpha={alpha:.3g}, "
            f"beta={beta:.3g}): the data do not show loss falling with both N and D"
        )
    if max(a, b, e) > 700:
        raise FitError("Chinchilla approach 3 diverged (a constant overflows)")
    return ChinchillaLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)


def _derived(law: ChinchillaLaw) -> dict[str, float]:
    n_law, d_law = chinchilla_optimal_laws(law)
    return {**law.as_dict(), "a": n_law.exponent, "b": d_law.exponent}


@blas_single_threaded
def fit_parametric(
    table: ResultsTable,
    *,
    delta: float = HUBER_DELTA,
    max_starts: int | None = 64,
    num_resamples: int = 0,
    bootstrap_starts: int = 4,
    seed: int = 0,
) -> ParametricFit:
    """Fit Chinchilla's parametric loss (approach 3) with bootstrap percentile intervals.

    Each bootstrap resample of runs is refitted from the full-data optimum plus the
    ``bootstrap_starts`` best grid points for that resample. Raises ``FitError`` when no start
    converges or the fit leaves the region where the law is defined.
    """
    require_points(len(table), 6, "Chinchilla approach 3 (5 parameters)")
    log_n, log_d, log_loss = np.log(table.params), np.log(table.tokens), np.log(table.loss)
    grid = default_grid()
    starts = _select_starts(grid, log_n, log_d, log_loss, max_starts, delta)
    theta, value, converged = _fit_point(log_n, log_d, log_loss, starts=starts, delta=delta)
    law = _theta_to_law(theta)

    def once(rng: np.random.Generator) -> dict[str, float]:
        idx = rng.integers(0, len(table), len(table))
        ln, ld, ll = log_n[idx], log_d[idx], log_loss[idx]
        sub_starts = _select_starts(grid, ln, ld, ll, bootstrap_starts, delta)
        sub_theta, _, _ = _fit_point(ln, ld, ll, starts=np.vstack([theta, sub_starts]),
                                     delta=delta)
        return _derived(_theta_to_law(sub_theta))

    samples, failures = bootstrap(once, num_resamples=num_resamples, seed=seed)
    return ParametricFit(
        law=law, objective=value, estimates=with_intervals(_derived(law), samples),
        converged_starts=converged, total_starts=len(starts), bootstrap_failures=failures,
    )


def log_residuals(law: ChinchillaLaw, table: ResultsTable) -> np.ndarray:
    """log(predicted loss) - log(observed loss) for each run."""
    return np.log(law.loss(table.params, table.tokens)) - np.log(table.loss)
