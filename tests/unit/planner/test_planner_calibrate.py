"""`plan --calibrate`: the GEMM curve fit recovers a known curve; bad requests say why."""

from __future__ import annotations

import pytest

from densetrain.planner.calibrate import collective_figures, fit_gemm_curve


def test_fit_recovers_the_rate_curve():
    rate, half = 5e11, 96.0
    sweep = [(s, rate * s / (s + half)) for s in (64, 128, 256, 512, 1024)]
    got_rate, got_half = fit_gemm_curve(sweep)
    assert got_rate == pytest.approx(rate, rel=1e-9)
    assert got_half == pytest.approx(half, rel=1e-9)


def test_collectives_need_two_ranks():
    with pytest.raises(ValueError, match="--calibrate-ranks must be >= 2"):
        collective_figures(1)


def test_collective_figures_on_two_gloo_ranks():
    bandwidth, latency = collective_figures(2, sizes_mb=(1,))
    assert bandwidth > 0 and latency > 0
