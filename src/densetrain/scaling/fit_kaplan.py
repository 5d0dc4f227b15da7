"""Kaplan et al. 2020 power-law fits from a table of runs: L(N), L(D), L(C) and L(N, D).

Which runs feed each single-variable law (Kaplan fits each on the runs not limited by the other
resources): L(N) uses, for each distinct N, its lowest loss; L(D) likewise for each distinct D;
L(C) uses the compute-efficient frontier, the runs whose loss is lower than that of every run
with less compute (Kaplan §6.1 uses the envelope of learning curves; final points are the
coarse version available from a results table). L(N, D) (eq. 1.5) is fitted to all runs by least
squares on log loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from densetrain.errors import UserError
from densetrain.scaling.fit_common import (
    Estimate,
    FitError,
    blas_single_threaded,
    bootstrap,
    fit_loglog,
    group_by_relative_value,
    require_points,
    with_intervals,
)
from densetrain.scaling.laws import KaplanNDLaw
from densetrain.scaling.results import ResultsTable


@dataclass(frozen=True, kw_only=True)
class SingleLawFit:
    """L(x) = (scale/x)^exponent fitted to ``x``, ``loss`` (the points actually used)."""

    variable: str
    scale: Estimate
    exponent: Estimate
    x: np.ndarray
    loss: np.ndarray

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The fitted law at ``x``."""
        return (self.scale.value / np.asarray(x, dtype=float)) ** self.exponent.value


@dataclass(frozen=True, kw_only=True)
class KaplanNDFit:
    """Kaplan eq. 1.5 fitted to all runs; ``law`` holds the point estimate."""

    law: KaplanNDLaw
    estimates: dict[str, Estimate]
    rms_log_residual: float


def _min_loss_per_value(x: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels = group_by_relative_value(x)
    xs, losses = [], []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        best = members[np.argmin(loss[members])]
        xs.append(x[best])
        losses.append(loss[best])
    return np.array(xs), np.array(losses)


def compute_frontier(flops: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Indices of runs whose loss is below that of every run with less compute (sorted by C)."""
    order = np.argsort(flops, kind="stable")
    keep, best = [], math.inf
    for idx in order:
        if loss[idx] < best:
            keep.append(idx)
            best = loss[idx]
    return np.array(keep, dtype=int)


def _select(variable: str, table: ResultsTable) -> tuple[np.ndarray, np.ndarray]:
    if variable == "N":
        return _min_loss_per_value(table.params, table.loss)
    if variable == "D":
        return _min_loss_per_value(table.tokens, table.loss)
    if variable == "C":
        keep = compute_frontier(table.flops, table.loss)
        return table.flops[keep], table.loss[keep]
    raise UserError(f"variable must be one of 'N', 'D', 'C', got {variable!r}")


def _fit_single_point(variable: str, table: ResultsTable) -> tuple[dict[str, float], tuple]:
    x, loss = _select(variable, table)
    require_points(len(x), 2, f"Kaplan L({variable})")
    law = fit_loglog(x, loss, what=f"Kaplan L({variable})")
    exponent = -law.exponent
    if exponent <= 0:
        raise FitError(
            f"Kaplan L({variable}): loss does not fall with {variable} (fitted exponent "
            f"{exponent:.3g} <= 0); L = (x_c/x)^alpha needs alpha > 0"
        )
    # scale = coefficient^(1/alpha): in log space, since a nearly flat L (alpha -> 0) puts
    # it beyond float range, which is a fit that says nothing rather than a number.
    log_scale = math.log(law.coefficient) / exponent
    if not log_scale < math.log(np.finfo(float).max):
        raise FitError(
            f"Kaplan L({variable}): the fitted exponent {exponent:.3g} is so small that the "
            f"scale {variable}_c = exp({log_scale:.3g}) is out of range; loss barely depends "
            f"on {variable} in these runs"
        )
    return {"scale": math.exp(log_scale), "exponent": exponent}, (x, loss)


def fit_kaplan_single(
    variable: str, table: ResultsTable, *, num_resamples: int = 0, seed: int = 0
) -> SingleLawFit:
    """Fit L(variable) = (scale/variable)^exponent, variable one of "N", "D", "C".

    Bootstrap: runs are resampled with replacement and the selection and fit are redone.
    """
    point, (x, loss) = _fit_single_point(variable, table)

    def once(rng: np.random.Generator) -> dict[str, float]:
        sample = table.subset(rng.integers(0, len(table), len(table)))
        return _fit_single_point(variable, sample)[0]

    samples, _ = bootstrap(once, num_resamples=num_resamples, seed=seed)
    est = with_intervals(point, samples)
    return SingleLawFit(variable=variable, scale=est["scale"], exponent=est["exponent"],
                        x=x, loss=loss)


def _nd_residuals(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray,
                  log_loss: np.ndarray) -> np.ndarray:
    log_nc, log_dc, alpha_n, alpha_d = theta
    inner = np.logaddexp((alpha_n / alpha_d) * (log_nc - log_n), log_dc - log_d)
    return alpha_d * inner - log_loss


def _fit_nd_point(table: ResultsTable) -> tuple[KaplanNDLaw, float]:
    require_points(len(table), 5, "Kaplan L(N, D) (4 parameters)")
    log_n, log_d, log_loss = np.log(table.params), np.log(table.tokens), np.log(table.loss)
    best = None
    for log_nc in (np.log(table.params.max()) + 5, 30.0):
        for alpha_n, alpha_d in ((0.076, 0.103), (0.3, 0.3), (0.05, 0.3)):
            start = np.array([log_nc, np.log(table.tokens.max()) + 5, alpha_n, alpha_d])
            res = least_squares(
                _nd_residuals, start, args=(log_n, log_d, log_loss),
                bounds=([-50, -50, 1e-4, 1e-4], [200, 200, 5.0, 5.0]), method="trf",
                x_scale=[10.0, 10.0, 0.1, 0.1], max_nfev=2000,
            )
            if res.success and (best is None or res.cost < best.cost):
                best = res
    if best is None:
        raise FitError("Kaplan L(N, D): least squares did not converge from any start")
    log_nc, log_dc, alpha_n, alpha_d = best.x
    law = KaplanNDLaw(n_c=math.exp(log_nc), d_c=math.exp(log_dc), alpha_n=float(alpha_n),
                      alpha_d=float(alpha_d))
    return law, float(np.sqrt(np.mean(best.fun**2)))


@blas_single_threaded
def fit_kaplan_nd(table: ResultsTable, *, num_resamples: int = 0, seed: int = 0) -> KaplanNDFit:
    """Fit Kaplan eq. 1.5 to every run by least squares on log loss, with bootstrap intervals."""
    law, rms = _fit_nd_point(table)

    def once(rng: np.random.Generator) -> dict[str, float]:
        sample = table.subset(rng.integers(0, len(table), len(table)))
        return _fit_nd_point(sample)[0].as_dict()

    samples, _ = bootstrap(once, num_resamples=num_resamples, seed=seed)
    return KaplanNDFit(law=law, estimates=with_intervals(law.as_dict(), samples),
                       rms_log_residual=rms)
