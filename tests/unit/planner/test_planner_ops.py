"""Per-operation compute costs and per-schedule bubbles."""

from __future__ import annotations

import numpy as np
import pytest

from densetrain.parallel.config import PP_SCHEDULES
from densetrain.planner import get_cluster
from densetrain.planner.ops import gemm_seconds
from densetrain.planner.timing import bubble_share


def test_large_gemm_runs_at_the_measured_efficiency():
    h100 = get_cluster("h100")
    n = 16384
    seconds = float(gemm_seconds(n, n, n, h100))
    achieved = 2 * n**3 / seconds / h100.peak_flops
    assert achieved == pytest.approx(h100.gemm_efficiency * n / (n + h100.gemm_half_dim))


def test_efficiency_falls_for_small_and_skinny_gemms():
    h100 = get_cluster("h100")
    rate = lambda m, n, k: 2 * m * n * k / float(gemm_seconds(m, n, k, h100))  # noqa: E731
    assert rate(8192, 8192, 8192) > rate(8192, 8192, 256) > rate(8192, 8192, 32)
    # A matrix-vector product is bound by memory: its bytes over HBM bandwidth.
    m, k = 8192, 8192
    assert float(gemm_seconds(m, 1, k, h100)) == pytest.approx(
        2 * (m * k + k + m) / h100.hbm_bytes_per_s)


def test_each_schedule_has_its_bubble():
    p, m = 8, 32
    index = {name: PP_SCHEDULES.index(name) for name in PP_SCHEDULES}
    share = {name: float(bubble_share(np.array(i), p, 2 if name in ("interleaved_1f1b",
                                                                     "zero_bubble", "zbv") else 1,
                                      m)) for name, i in index.items()}
    assert share["gpipe"] == share["1f1b"] == pytest.approx((p - 1) / m)
    assert share["interleaved_1f1b"] == pytest.approx((p - 1) / (2 * m))
    assert share["zero_bubble"] == pytest.approx(share["interleaved_1f1b"] / 3)
    assert share["zbv"] == 0.0
    assert float(bubble_share(np.array(index["zbv"]), p, 2, 8)) > 0
    assert float(bubble_share(np.array(index["1f1b"]), 1, 1, m)) == 0.0
