"""MFU against PaLM's published figure, the accelerator table, the CPU probe and its source, the
MFU warning, the JSONL writer."""

from __future__ import annotations

import math

import pytest
import torch

from densetrain.train import (
    MetricsWriter,
    accelerator_peak_flops,
    device_peak_flops,
    measure_cpu_peak_flops,
    mfu,
    read_metrics,
)
from densetrain.train.metrics import (
    CPU_PROBE_RUNS,
    PINNED_PEAK_SOURCE,
    cpu_bf16_warning,
    mfu_warning,
    run_peak_flops,
)


def test_mfu_reproduces_palm_540b_table_3() -> None:
    # PaLM (Chowdhery et al. 2022) Appendix B: 6N + 12·L·H·Q·T FLOPs per token with N = 540.35e9,
    # L = 118, H = 48, Q = 256, T = 2048; 238.3K tokens/s on 6144 TPU v4 (275 TFLOP/s bf16 each)
    # is reported as 46.2% MFU (Table 3).
    flops_per_token = 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    assert mfu(238.3e3, flops_per_token, 275e12, 6144) == pytest.approx(0.462, abs=0.001)


def test_accelerator_table_matches_datasheets() -> None:
    assert accelerator_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert accelerator_peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert accelerator_peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert accelerator_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert accelerator_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(156e12)
    assert accelerator_peak_flops("Some Future Chip", "bf16") is None


def test_cpu_probe_is_a_plausible_matmul_rate_and_says_how_it_was_found() -> None:
    peak = measure_cpu_peak_flops("fp32", size=256, runs=3, seconds_per_run=0.02)
    assert 1e8 < peak < 1e14
    source = device_peak_flops(torch.device("cpu"), "fp32")[1]
    assert source.startswith(f"probed best of {CPU_PROBE_RUNS} fp32 matmul runs"), source
    assert run_peak_flops(torch.device("cpu"), "fp32", 2.5) == (2.5e12, PINNED_PEAK_SOURCE)
    assert math.isnan(mfu(100.0, 1e6, math.nan, 1))


def test_the_probe_adds_the_doubled_size_only_where_one_matmul_of_it_is_quick(monkeypatch):
    """AMX reaches its bf16 rate only on larger matmuls than MKL's fp32 peak needs: the doubled
    size is probed when one matmul of it takes at most PROBE_LARGER_MAX_S at the first rate."""
    from densetrain.train import metrics

    monkeypatch.setattr(metrics, "_CPU_PEAK_CACHE", {})  # restored afterwards
    for first, sizes in [(1e12, [256, 512]), (2 * 512**3 / 0.03, [256])]:
        seen = []
        rates = {256: first, 512: 2 * first}

        def probe(size, *args, seen=seen, rates=rates):
            seen.append(size)
            return rates[size]

        monkeypatch.setattr(metrics, "_probe_square_matmuls", probe)
        peak = measure_cpu_peak_flops("bf16", size=256, fresh=True)
        assert seen == sizes
        assert peak == rates[sizes[-1]]


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU has oneDNN bf16 kernels")
def test_a_cpu_without_bf16_kernels_warns_a_bf16_run_and_takes_its_fp32_peak() -> None:
    # torch's own capability check says this CPU has no oneDNN bf16 kernels (e.g. AVX2-only
    # x86), so its bf16 matmuls run in reference loops, slower than MKL's fp32 sgemm.
    cpu = torch.device("cpu")
    warning = cpu_bf16_warning(cpu, "bf16")
    assert warning is not None
    assert warning.startswith("warning: training.dtype=bf16 is slower than fp32 on this CPU")
    assert "--training.dtype=fp32" in warning
    assert cpu_bf16_warning(cpu, "float8").startswith("warning: training.dtype=float8 ")
    assert cpu_bf16_warning(cpu, "fp32") is None
    assert cpu_bf16_warning(torch.device("meta"), "bf16") is None
    # MFU divides by the machine's best rate, its fp32 one, not by the slower bf16 loop
    peak, source = device_peak_flops(cpu, "bf16")
    assert peak == measure_cpu_peak_flops("fp32") > measure_cpu_peak_flops("bf16")
    assert source.startswith(f"probed best of {CPU_PROBE_RUNS} fp32 matmul runs"), source
    assert "bf16 matmuls are slower" in source


def test_mfu_above_100_percent_is_warned_naming_the_fix() -> None:
    assert mfu_warning(0.999, 1e11, "x") is None
    assert mfu_warning(math.nan, 1e11, "x") is None
    warning = mfu_warning(1.74, 0.21e12, "probed best of 5 fp32 matmul runs, 2 threads")
    assert "174%" in warning and "0.21 TFLOP/s" in warning and "probed best of 5" in warning
    assert "--logging.peak_tflops" in warning


def test_metrics_writer_drops_steps_after_the_resumed_checkpoint(tmp_path) -> None:
    writer = MetricsWriter(tmp_path)
    for step in range(1, 6):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()
    writer = MetricsWriter(tmp_path, resume_step=3)
    writer.write({"step": 4, "loss": 0.3})
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0), (2, 0.5), (3, 1.0 / 3), (4, 0.3)
    ]


def test_a_torn_last_record_is_left_out_and_dropped_on_resume(tmp_path, capsys) -> None:
    writer = MetricsWriter(tmp_path)
    for step in range(1, 6):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.close()
    path = tmp_path / "metrics.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 9])  # the last write cut short, as a kill or full disk does
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    writer = MetricsWriter(tmp_path, resume_step=5)  # resumed from a checkpoint of step 5
    assert "dropped a torn last line" in capsys.readouterr().err
    writer.write({"step": 5, "loss": 0.25})
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)][-2:] == [(4, 0.25), (5, 0.25)]


def test_float8_where_its_matmuls_are_emulated_is_said_at_start_up() -> None:
    from densetrain.train.metrics import float8_emulation_warning

    cpu = torch.device("cpu")
    warning = float8_emulation_warning(cpu, "float8")
    assert warning.startswith("warning: training.dtype=float8 emulates its float8 matmuls "
                              "here: a CPU has no float8 matmul units")
    assert "--training.dtype=bf16" in warning
    assert float8_emulation_warning(cpu, "bf16") is None
    # the capability rule on CUDA, given (no GPU is needed to read it): A100 8.0 emulates
    cuda = torch.device("cuda")
    assert "compute capability 8.0" in float8_emulation_warning(cuda, "float8", (8, 0))
    assert float8_emulation_warning(cuda, "float8", (8, 9)) is None
    assert float8_emulation_warning(cuda, "float8", (9, 0)) is None

