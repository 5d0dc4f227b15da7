"""Kaplan et al. 2020 fits on data generated from its published constants (Tables 2 and 5)."""

import numpy as np
import pytest

from densetrain.scaling.fit_common import FitError
from densetrain.scaling.fit_kaplan import compute_frontier, fit_kaplan_nd, fit_kaplan_single
from densetrain.scaling.laws import (
    KAPLAN_ALPHA_N,
    KAPLAN_N_C,
    KAPLAN_ND,
    power_law,
)
from densetrain.scaling.results import table_from_rows


def _rows(n_values, d_values, loss_fn, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in n_values:
        for d in d_values:
            loss = float(loss_fn(n, d)) * float(np.exp(rng.normal(0, noise)))
            rows.append({"params": n, "tokens": d, "flops": 6 * n * d, "loss": loss})
    return rows


def test_l_of_n_recovers_published_alpha_and_scale():
    n_values = np.geomspace(1e6, 1e9, 8)
    rows = _rows(n_values, [1e10], lambda n, d: power_law(n, KAPLAN_N_C, KAPLAN_ALPHA_N),
                 noise=0.002)
    fit = fit_kaplan_single("N", table_from_rows(rows), num_resamples=30, seed=0)
    assert fit.exponent.value == pytest.approx(KAPLAN_ALPHA_N, abs=0.005)
    assert np.log10(fit.scale.value) == pytest.approx(np.log10(KAPLAN_N_C), abs=0.6)
    assert fit.exponent.low < KAPLAN_ALPHA_N < fit.exponent.high


def test_l_of_n_takes_the_least_data_limited_run_per_size():
    n_values = np.geomspace(1e6, 1e9, 6)
    rows = _rows(n_values, [1e8, 1e9, 1e11], KAPLAN_ND.loss)
    fit = fit_kaplan_single("N", table_from_rows(rows))
    assert len(fit.x) == 6
    assert np.allclose(fit.loss, KAPLAN_ND.loss(fit.x, 1e11))


def test_compute_frontier_keeps_runs_beating_all_cheaper_ones():
    flops = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    loss = np.array([5.0, 4.0, 4.5, 3.0, 3.5])
    assert compute_frontier(flops, loss).tolist() == [0, 1, 3]


def test_l_of_n_d_recovers_table2_constants():
    rows = _rows(np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 6), KAPLAN_ND.loss,
                 noise=0.001, seed=2)
    fit = fit_kaplan_nd(table_from_rows(rows))
    assert fit.law.alpha_n == pytest.approx(0.076, abs=0.01)
    assert fit.law.alpha_d == pytest.approx(0.103, abs=0.015)
    assert fit.rms_log_residual < 0.003


def test_rising_loss_is_not_a_power_law():
    rows = _rows([1e6, 1e7, 1e8], [1e9], lambda n, d: 1 + np.log10(n))
    with pytest.raises(FitError, match="does not fall"):
        fit_kaplan_single("N", table_from_rows(rows))


def test_unknown_variable():
    rows = _rows([1e6, 1e7], [1e9], lambda n, d: 3.0)
    with pytest.raises(ValueError, match="variable"):
        fit_kaplan_single("Q", table_from_rows(rows))


def test_nearly_flat_loss_is_a_fit_error_not_an_overflow():
    # L falls by 0.01% over three decades: alpha ~ 1.4e-5 puts N_c = 3^(1/alpha) past 1e308
    rows = _rows([1e6, 1e7, 1e8, 1e9], [1e9], lambda n, d: 3.0 * (1e6 / n) ** 1.4e-5)
    with pytest.raises(FitError, match="out of range"):
        fit_kaplan_single("N", table_from_rows(rows))
