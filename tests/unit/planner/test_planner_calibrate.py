"""`plan --calibrate`: the GEMM curve fit recovers a known curve; bad requests say why."""

from __future__ import annotations

import pytest

from densetrain.planner.calibrate import collective_figures, fit_alpha_beta, fit_gemm_curve


def test_fit_recovers_the_rate_curve():
    rate, half = 5e11, 96.0
    sweep = [(s, rate * s / (s + half)) for s in (64, 128, 256, 512, 1024)]
    got_rate, got_half = fit_gemm_curve(sweep)
    assert got_rate == pytest.approx(rate, rel=1e-9)
    assert got_half == pytest.approx(half, rel=1e-9)


def test_collectives_need_two_ranks():
    with pytest.raises(ValueError, match="--calibrate-ranks must be >= 2"):
        collective_figures(1)


def test_cli_refuses_one_rank_before_measuring_and_writes_nothing(tmp_path, capsys):
    from densetrain.cli.main import main

    out = tmp_path / "machine.toml"
    with pytest.raises(SystemExit) as refused:  # by the parser, before any measurement
        main(["plan", "--calibrate", str(out), "--calibrate-ranks", "1"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "argument --calibrate-ranks: must be an integer >= 2" in err and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_collective_calibration_that_times_out_says_so():
    # Real ranks, a real deadline too short for them to start: the failure is named.
    with pytest.raises(RuntimeError, match="collective calibration on 2 local gloo ranks failed"):
        collective_figures(2, timeout_s=0.5)


def test_collective_figures_on_two_gloo_ranks():
    bandwidth, alpha = collective_figures(2, sizes_kib=(64, 1024, 8192))
    assert bandwidth > 0 and alpha >= 0


def test_alpha_beta_fit_recovers_a_known_link():
    alpha, bandwidth = 3e-4, 2e9
    points = [(s, alpha + s / bandwidth) for s in (2**16, 2**20, 2**24)]
    got_bandwidth, got_alpha = fit_alpha_beta(points)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    with pytest.raises(RuntimeError, match="do not grow with the payload"):
        fit_alpha_beta([(1, 2.0), (2, 1.0)])


def test_host_time_per_layer_on_two_gloo_ranks():
    from densetrain.planner.calibrate import layer_host_seconds

    host = layer_host_seconds(2, alpha=0.0, repeats=3)
    # DTensor dispatches each op through Python and adds collectives, FSDP2 adds hooks, copies
    # and collectives: both take more host time per layer than plain eager, in the forward +
    # backward and in the optimizer step (DTensor parameters).
    for k in (0, 1):
        assert 0 < host["plain"][k] < min(host["tp"][k], host["fsdp"][k])
