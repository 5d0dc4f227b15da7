"""Chinchilla approaches 1 and 2 on runs generated from a known law: the recovered exponents and
minima against the closed form of that law (Hoffmann et al. 2022, eq. 4)."""

import numpy as np
import pytest

from densetrain.scaling.fit_common import FitError
from densetrain.scaling.fit_isoflop import (
    LossCurve,
    budgets_of,
    envelope_points,
    fit_envelope,
    fit_isoflop,
    fit_profile,
)
from densetrain.scaling.laws import CHINCHILLA_UNROUNDED as LAW
from densetrain.scaling.optimal import chinchilla_optimal, chinchilla_optimal_laws
from densetrain.scaling.results import table_from_rows

TRUE_A = chinchilla_optimal_laws(LAW)[0].exponent


def test_isoflop_minima_and_exponent_match_closed_form(make_isoflop_rows):
    table = table_from_rows(make_isoflop_rows(sizes=9, span=10.0))
    fit = fit_isoflop(table)
    for profile in fit.profiles:
        assert profile.minimum_inside
        closed_form = chinchilla_optimal(LAW, profile.budget).num_params
        assert profile.n_opt == pytest.approx(closed_form, rel=0.05)
    assert fit.estimates["a"].value == pytest.approx(TRUE_A, abs=0.01)
    assert fit.estimates["a"].value + fit.estimates["b"].value == pytest.approx(1.0, abs=1e-9)


def test_isoflop_bootstrap_interval_brackets_estimate(chinchilla_table):
    fit = fit_isoflop(chinchilla_table, num_resamples=30, seed=0)
    est = fit.estimates["a"]
    assert est.low < est.value < est.high
    assert est.low - 0.02 < TRUE_A < est.high + 0.02


def test_budgets_group_flops_without_budget_column(make_isoflop_rows):
    rows = make_isoflop_rows(budgets=(1e18, 1e19), sizes=4)
    for i, row in enumerate(rows):
        del row["budget"]
        row["flops"] *= 1 + 0.001 * (i % 3)  # rounding of D to whole steps
    labels = budgets_of(table_from_rows(rows))
    assert len(np.unique(labels)) == 2


def test_profile_without_minimum_says_so():
    params = np.array([1e6, 2e6, 4e6, 8e6])
    loss = np.array([3.0, 3.3, 3.4, 3.3])  # concave: a maximum, not a minimum
    with pytest.raises(FitError, match="no minimum"):
        fit_profile(1e15, params, loss)


def test_profile_needs_three_sizes():
    with pytest.raises(FitError, match="at least 3"):
        fit_profile(1e15, np.array([1e6, 2e6, 2e6]), np.array([3.0, 2.9, 2.9]))


def test_budget_without_minimum_is_left_out_and_named(make_isoflop_rows):
    rows = make_isoflop_rows(budgets=(1e18, 1e19, 1e20), sizes=5, span=10.0)
    for row in rows:
        if row["budget"] == 1e20:  # loss falls ever faster across the range: no minimum
            x = float(np.log(row["params"]))
            row["loss"] = 9.0 - 0.1 * x - 0.02 * (x - 15.0) ** 2
    fit = fit_isoflop(table_from_rows(rows), num_resamples=5)
    assert list(fit.without_minimum) == [1e20]
    assert "no minimum" in fit.without_minimum[1e20]
    assert fit.flops.tolist() == [1e18, 1e19]


def test_single_budget_cannot_give_a_power_law(make_isoflop_rows):
    with pytest.raises(FitError, match="budgets"):
        fit_isoflop(table_from_rows(make_isoflop_rows(budgets=(1e18,))))


def _synthetic_curves(sizes):
    curves = []
    for n in sizes:
        tokens = np.geomspace(1e7, 1e12, 200)
        curves.append(LossCurve(params=n, tokens=tokens, loss=LAW.loss(n, tokens)))
    return curves


def test_envelope_recovers_exponent():
    curves = _synthetic_curves(np.geomspace(1e7, 3e10, 40))
    fit = fit_envelope(curves, num_points=30)
    assert fit.estimates["a"].value == pytest.approx(TRUE_A, abs=0.04)
    flops, n_opt, _ = envelope_points(curves, num_points=30)
    # where the closed-form optimum is among the sizes trained, the envelope's winner is
    # within about one size step (a factor 3e3^(1/39)) of it
    closed = np.array([chinchilla_optimal(LAW, c).num_params for c in flops])
    inside = (closed > 1e7) & (closed < 3e10)
    assert inside.sum() > 10
    step = np.log(3e3) / 39
    assert np.all(np.abs(np.log(n_opt[inside] / closed[inside])) < 1.5 * step)


def test_envelope_bootstrap_and_too_few_sizes():
    curves = _synthetic_curves(np.geomspace(1e7, 3e10, 12))
    fit = fit_envelope(curves, num_points=20, num_resamples=10, seed=1)
    assert fit.estimates["a"].low is not None
    with pytest.raises(FitError, match="model sizes"):
        fit_envelope(_synthetic_curves([1e8]))
