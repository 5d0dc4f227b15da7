"""The sweep recorded in docs/scaling.md: its runs reproduce the documented fit.

The rows are real runs of `densetrain scaling sweep` (docs/scaling/results.csv and runs/); the
fit is recomputed here, so a change to the fitters that moves the documented numbers fails.
"""

from pathlib import Path

import numpy as np
import pytest

from densetrain.scaling.fit_isoflop import fit_isoflop
from densetrain.scaling.fit_parametric import fit_parametric
from densetrain.scaling.results import load_results_csv

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "scaling" / "results.csv"


@pytest.fixture(scope="module")
def table():
    return load_results_csv(RESULTS)


def test_every_isoflop_profile_has_its_minimum_inside_and_n_opt_grows(table):
    fit = fit_isoflop(table)
    assert list(fit.flops) == [1e12, 3e12, 1e13]
    assert not fit.without_minimum
    assert all(p.minimum_inside for p in fit.profiles)
    assert np.all(np.diff(fit.n_opt) > 0)
    # docs/scaling.md: vertices 98k, 179k, 311k; a = 0.50
    np.testing.assert_allclose(fit.n_opt, [98_082, 179_193, 311_363], rtol=1e-3)
    assert fit.estimates["a"].value == pytest.approx(0.501, abs=0.005)


def test_parametric_fit_gives_the_documented_exponent(table):
    fit = fit_parametric(table)
    a = fit.law.beta / (fit.law.alpha + fit.law.beta)
    assert a == pytest.approx(0.512, abs=0.01)
