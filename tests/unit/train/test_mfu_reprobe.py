"""A probed peak that reads low (MFU above 100%) is probed again, and the run says which."""

from __future__ import annotations

import time

import pytest
import torch

from densetrain.models.linear import linear
from densetrain.train.metrics import MAX_REPROBES, RunPeak, measure_cpu_peak_flops, mfu


def _achieved_flops(size: int = 256, seconds: float = 0.05) -> float:
    """FLOP/s of real back-to-back matmuls on this CPU: a rate no higher than its peak."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    linear(a, b)
    done, start = 0, time.perf_counter()
    while done < 2 or time.perf_counter() - start < seconds:
        linear(a, b)
        done += 1
    return 2.0 * size**3 * done / (time.perf_counter() - start)


def test_a_low_first_probe_is_probed_again_and_mfu_stays_at_most_100_percent() -> None:
    achieved = _achieved_flops() / 4  # a quarter of one run's rate: well under the peak
    flops_per_token = 1e6
    tokens_per_s = achieved / flops_per_token
    readings: list[float] = []

    def reprobe() -> float:
        readings.append(measure_cpu_peak_flops("fp32", fresh=True))
        return readings[-1]

    low = achieved / 3  # the first probe, taken on a busy machine, read low
    peak = RunPeak(low, "probed", reprobe=reprobe)
    assert mfu(tokens_per_s, flops_per_token, low, 1) > 1
    value = peak.mfu(tokens_per_s, flops_per_token, 1, step=7)
    assert readings and peak.flops == max(readings)
    assert value == pytest.approx(achieved / peak.flops)
    assert value <= 1
    assert peak.step == 7 and "re-probed at step 7" in peak.source
    assert "re-probed at step 7" in peak.describe()
    for step in (8, 9, 10):
        assert peak.mfu(tokens_per_s, flops_per_token, 1, step=step) <= 1
    assert len(readings) <= MAX_REPROBES


def test_a_pinned_peak_is_never_reprobed_and_reprobes_are_bounded() -> None:
    pinned = RunPeak(1e9, "pinned by logging.peak_tflops")
    assert pinned.mfu(2e3, 1e6, 1, step=3) == pytest.approx(2.0)
    assert pinned.step is None and pinned.source == "pinned by logging.peak_tflops"
    calls = []
    stuck = RunPeak(1e9, "probed", reprobe=lambda: calls.append(1) or 5e8)
    assert stuck.mfu(2e3, 1e6, 1, step=3) == pytest.approx(2.0)
    stuck.mfu(2e3, 1e6, 1, step=4)
    assert len(calls) == MAX_REPROBES and stuck.step is None
    assert stuck.source == "probed, at start"
