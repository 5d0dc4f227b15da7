"""Synthetic run tables generated from known scaling-law constants."""

import numpy as np
import pytest

from densetrain.scaling.laws import CHINCHILLA_UNROUNDED
from densetrain.scaling.results import table_from_rows


def isoflop_rows(law=CHINCHILLA_UNROUNDED, *, budgets=(1e18, 1e19, 1e20, 1e21), sizes=7,
                 noise=0.0, seed=0, span=30.0):
    """Runs on IsoFLOP lines around each budget's optimum, loss from ``law`` times log-normal
    noise of relative size ``noise``."""
    from densetrain.scaling.optimal import chinchilla_optimal

    rng = np.random.default_rng(seed)
    rows = []
    for budget in budgets:
        centre = chinchilla_optimal(law, budget).num_params
        for n in centre * np.geomspace(1 / np.sqrt(span), np.sqrt(span), sizes):
            d = budget / (6 * n)
            loss = float(law.loss(n, d)) * float(np.exp(rng.normal(0.0, noise)))
            rows.append({"params": n, "tokens": d, "flops": budget, "loss": loss,
                         "budget": budget})
    return rows


@pytest.fixture
def make_isoflop_rows():
    """The ``isoflop_rows`` generator, for tests that need other constants or budgets."""
    return isoflop_rows


@pytest.fixture
def chinchilla_table():
    """IsoFLOP runs from Chinchilla's published law with 0.3% noise."""
    return table_from_rows(isoflop_rows(noise=0.003, seed=1))
