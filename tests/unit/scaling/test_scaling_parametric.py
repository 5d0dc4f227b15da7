"""Chinchilla approach 3 (Appendix D.2): recovery of known constants, the objective's gradient,
bootstrap intervals, and a fit that cannot converge."""

import numpy as np
import pytest
from scipy.optimize import check_grad

from densetrain.scaling.fit_common import FitError
from densetrain.scaling.fit_parametric import (
    default_grid,
    fit_parametric,
    huber_objective,
    log_residuals,
)
from densetrain.scaling.laws import ChinchillaLaw
from densetrain.scaling.results import table_from_rows


def test_grid_is_the_papers():
    grid = default_grid()
    assert grid.shape == (6 * 6 * 5 * 5 * 5, 5)
    assert sorted(set(grid[:, 0])) == [0, 5, 10, 15, 20, 25]
    assert sorted(set(grid[:, 2])) == [-1, -0.5, 0, 0.5, 1]
    assert sorted(set(grid[:, 3])) == [0, 0.5, 1, 1.5, 2]


def test_gradient_matches_finite_differences(make_isoflop_rows):
    table = table_from_rows(make_isoflop_rows(noise=0.01, seed=3))
    args = (np.log(table.params), np.log(table.tokens), np.log(table.loss), 0.05)
    theta = np.array([6.0, 6.0, 0.5, 0.34, 0.28])
    err = check_grad(lambda t: huber_objective(t, *args)[0],
                     lambda t: huber_objective(t, *args)[1], theta, epsilon=1e-7)
    assert err < 1e-3 * np.linalg.norm(huber_objective(theta, *args)[1])


def test_recovers_chinchilla_constants_from_noisy_runs(chinchilla_table):
    fit = fit_parametric(chinchilla_table, max_starts=24)
    law = fit.law
    assert law.E == pytest.approx(1.6934, rel=0.03)
    assert law.alpha == pytest.approx(0.3392, abs=0.03)
    assert law.beta == pytest.approx(0.2849, abs=0.03)
    assert fit.estimates["a"].value == pytest.approx(0.2849 / (0.3392 + 0.2849), abs=0.02)
    assert np.sqrt(np.mean(log_residuals(law, chinchilla_table) ** 2)) < 0.006


def test_recovers_other_constants_exactly_without_noise(make_isoflop_rows):
    truth = ChinchillaLaw(E=2.1, A=120.0, B=900.0, alpha=0.45, beta=0.33)
    table = table_from_rows(make_isoflop_rows(truth, budgets=(1e15, 1e16, 1e17, 1e18)))
    law = fit_parametric(table, max_starts=24).law
    for name, value in truth.as_dict().items():
        assert getattr(law, name) == pytest.approx(value, rel=1e-3), name


def test_bootstrap_interval_covers_the_truth(chinchilla_table):
    fit = fit_parametric(chinchilla_table, max_starts=16, num_resamples=8, seed=0,
                         bootstrap_starts=2)
    for name, truth in (("alpha", 0.3392), ("beta", 0.2849)):
        est = fit.estimates[name]
        assert est.low <= est.value <= est.high
        assert est.low - 0.02 <= truth <= est.high + 0.02, (name, est)


def test_loss_rising_with_size_does_not_converge_to_numbers(make_isoflop_rows):
    rows = make_isoflop_rows(noise=0.0)
    for row in rows:  # loss grows with both N and D: no decreasing power law fits
        row["loss"] = 1.0 + 1e-3 * row["params"] ** 0.3 + 1e-3 * row["tokens"] ** 0.2
    with pytest.raises(FitError, match="approach 3"):
        fit_parametric(table_from_rows(rows), max_starts=8)


def test_too_few_runs_is_an_error(make_isoflop_rows):
    table = table_from_rows(make_isoflop_rows(budgets=(1e18,), sizes=5))
    with pytest.raises(FitError, match="at least 6 points"):
        fit_parametric(table)


def test_single_threaded_blas_restores_thread_counts():
    from densetrain.scaling.fit_common import _loaded_openblas, single_threaded_blas

    handles = _loaded_openblas()
    before = [get() for get, _ in handles]
    with single_threaded_blas():
        assert all(get() == 1 for get, _ in handles)
    assert [get() for get, _ in handles] == before
