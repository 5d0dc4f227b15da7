"""Compute-optimal allocation against the papers: Chinchilla eq. 4 / Figure 4 / Table A3 and
Kaplan et al. 2020 eqs. 1.7-1.8 / Table 6."""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from densetrain.scaling import references as ref
from densetrain.scaling.laws import (
    CHINCHILLA_UNROUNDED,
    KAPLAN_ALPHA_B,
    KAPLAN_ALPHA_N,
    KAPLAN_ALPHA_S,
    KAPLAN_TABLE6_EXPONENTS,
)
from densetrain.scaling.optimal import (
    PowerLaw,
    chinchilla_optimal,
    chinchilla_optimal_laws,
    kaplan_allocation_exponents,
    optimal_from_power_laws,
    params_exponent_from_data_exponent,
)


def test_chinchilla_closed_form_gives_40b_at_gopher_budget():
    # Hoffmann et al. 2022, Figure 4: approach 3 puts the Gopher budget (5.76e23 FLOPs) at ~40B.
    alloc = chinchilla_optimal(CHINCHILLA_UNROUNDED, ref.GOPHER_BUDGET_FLOPS)
    assert abs(alloc.num_params - ref.CHINCHILLA_FIG4_NOPT) < 1e9
    assert alloc.num_tokens * alloc.num_params * 6 == pytest.approx(ref.GOPHER_BUDGET_FLOPS,
                                                                    rel=1e-9)


def test_chinchilla_closed_form_matches_table_a3_67b():
    # Table A3 (approach 3): 67B parameters at 1.71e24 FLOPs (printed rounded).
    alloc = chinchilla_optimal(CHINCHILLA_UNROUNDED, ref.TABLE_A3_FLOPS)
    assert alloc.num_params == pytest.approx(ref.TABLE_A3_NOPT, rel=0.03)


@pytest.mark.parametrize("flops", [1e18, 1e21, 5.76e23])
def test_closed_form_is_the_minimum_of_the_law_on_the_isoflop_line(flops):
    # Independent check: minimise L(N, C/(6N)) numerically over log N.
    law = CHINCHILLA_UNROUNDED
    res = minimize_scalar(lambda x: law.loss(math.exp(x), flops / (6 * math.exp(x))),
                          bounds=(0, 60), method="bounded", options={"xatol": 1e-10})
    assert chinchilla_optimal(law, flops).num_params == pytest.approx(math.exp(res.x), rel=1e-4)


def test_closed_form_exponents_are_beta_and_alpha_over_their_sum():
    law = CHINCHILLA_UNROUNDED
    n_law, d_law = chinchilla_optimal_laws(law)
    assert n_law.exponent == pytest.approx(0.2849 / (0.3392 + 0.2849))
    assert n_law.exponent + d_law.exponent == pytest.approx(1.0)
    # Table 2 of the paper reports a = 0.46 for approach 3.
    assert round(n_law.exponent, 2) == ref.CHINCHILLA_APPROACH3_A


def test_kaplan_exponents_from_published_alphas():
    # Kaplan eqs. 1.7-1.8 with alpha_S = 0.76, alpha_B = 0.21, alpha_N = 0.076 (Table 5).
    exps = kaplan_allocation_exponents(KAPLAN_ALPHA_N, KAPLAN_ALPHA_B, KAPLAN_ALPHA_S)
    assert exps["N"] + exps["B"] + exps["S"] == pytest.approx(1.0)
    assert exps["alpha_c"] == pytest.approx(1 / (1 / 0.76 + 1 / 0.21 + 1 / 0.076))
    # "closely matches the empirically optimal N ∝ C^0.73, B ∝ C^0.24" (Kaplan §1.2).
    assert exps["N"] == pytest.approx(ref.KAPLAN_N_EXPONENT, abs=0.05)
    assert exps["B"] == pytest.approx(ref.KAPLAN_B_EXPONENT, abs=0.02)


def test_kaplan_table6_params_exponent_from_data_exponent():
    # Under C = 6·N·D the published D ∝ C^0.27 leaves N ∝ C^0.73 (Kaplan Table 6).
    assert params_exponent_from_data_exponent(KAPLAN_TABLE6_EXPONENTS["D"]) == pytest.approx(
        KAPLAN_TABLE6_EXPONENTS["N"])
    assert KAPLAN_TABLE6_EXPONENTS["B"] + KAPLAN_TABLE6_EXPONENTS["S"] == pytest.approx(
        KAPLAN_TABLE6_EXPONENTS["D"])


def test_optimal_from_power_laws_defaults_tokens_to_budget_over_6n():
    alloc = optimal_from_power_laws(PowerLaw(coefficient=0.1, exponent=0.5), None, 1e20)
    assert alloc.num_params == pytest.approx(1e9)
    assert alloc.num_tokens == pytest.approx(1e20 / 6e9)
    assert np.isclose(PowerLaw(coefficient=2.0, exponent=1.0)(3.0), 6.0)


@pytest.mark.parametrize("flops", [0, -1.0, float("nan"), float("inf")])
def test_bad_budget_is_rejected(flops):
    with pytest.raises(ValueError, match="flops"):
        chinchilla_optimal(CHINCHILLA_UNROUNDED, flops)
