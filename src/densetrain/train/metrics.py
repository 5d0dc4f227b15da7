"""Throughput and model FLOPs utilisation (MFU), and the metrics writers (JSONL, TensorBoard).

MFU = achieved model FLOP/s ÷ peak FLOP/s of the devices (Chowdhery et al. 2022, PaLM §4.1 and
Appendix B), with model FLOPs per token from `densetrain.models.sizing.flops_per_token_palm`
(6N + 12·L·H·Q·T: rematerialisation is not counted). Peaks of accelerators come from a table of
vendor datasheet dense (non-sparse) numbers; on CPU the peak is measured with a short matmul
probe, because CPU peaks depend on core count, clocks and the instruction set in use.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

# Dense peak TFLOP/s per device: (bf16, fp32-path). The fp32 column is TF32 tensor-core math
# where the part has it (PyTorch uses TF32 for fp32 matmuls when allowed), else plain FP32.
# Sources: NVIDIA A100 datasheet (2021), H100 datasheet (2023, SXM5 / PCIe), H200 datasheet
# (2024), B200 (DGX B200 datasheet, per GPU), L4/L40S/A10 datasheets, V100 (fp16 tensor cores),
# AMD Instinct MI250X / MI300X datasheets.
ACCELERATOR_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "B200": (2250.0, 1100.0),
    "H200": (989.4, 494.7),
    "H100 SXM": (989.4, 494.7),
    "H100 NVL": (835.0, 417.5),
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.4, 494.7),
    "H800": (989.4, 494.7),
    "GH200": (989.4, 494.7),
    "A100": (312.0, 156.0),
    "A800": (312.0, 156.0),
    "L40S": (362.1, 183.0),
    "L4": (121.0, 60.0),
    "A10G": (70.0, 35.0),
    "A10": (125.0, 62.5),
    "V100": (125.0, 15.7),
    "MI300X": (1307.4, 653.7),
    "MI250X": (383.0, 95.7),
}

_CPU_PEAK_CACHE: dict[tuple[str, int], float] = {}


def accelerator_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a named accelerator for ``dtype`` ("bf16"/"fp32"), or None if unknown.

    The longest table key contained in ``device_name`` wins ("NVIDIA H100 80GB HBM3" → "H100").
    """
    matches = [key for key in ACCELERATOR_PEAK_TFLOPS if key.lower() in device_name.lower()]
    if not matches:
        return None
    bf16, fp32 = ACCELERATOR_PEAK_TFLOPS[max(matches, key=len)]
    return (bf16 if dtype == "bf16" else fp32) * 1e12


def measure_cpu_peak_flops(dtype: str = "fp32", *, size: int = 1024, seconds: float = 0.3) -> float:
    """Best sustained FLOP/s of a square matmul on this CPU with the current thread count.

    Cached per (dtype, threads). ``size`` 1024 keeps the probe in cache-friendly, MKL/oneDNN
    peak territory; the best of several timed repetitions over ``seconds`` is returned.
    """
    threads = torch.get_num_threads()
    key = (dtype, threads)
    if key in _CPU_PEAK_CACHE:
        return _CPU_PEAK_CACHE[key]
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(torch_dtype)
    b = torch.randn(size, size, generator=gen).to(torch_dtype)
    torch.mm(a, b)  # warm-up (thread pool, kernel selection)
    best = math.inf
    deadline = time.perf_counter() + seconds
    repeats = 0
    while repeats < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        repeats += 1
    peak = 2.0 * size**3 / best
    _CPU_PEAK_CACHE[key] = peak
    return peak


def device_peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` for ``dtype`` and where the figure came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = accelerator_peak_flops(name, dtype)
        if peak is not None:
            return peak, f"datasheet {name}"
        return math.nan, f"unknown accelerator {name} (add it to ACCELERATOR_PEAK_TFLOPS)"
    if device.type == "cpu":
        return measure_cpu_peak_flops(dtype), f"cpu matmul probe, {torch.get_num_threads()} threads"
    return math.nan, f"no peak known for device type {device.type}"


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of ``num_devices`` devices."""
    if not peak_flops or math.isnan(peak_flops) or num_devices <= 0:
        return math.nan
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl``; mirrors to TensorBoard.

    On resume, lines of steps after ``resume_step`` (written by the interrupted run after its
    last checkpoint) are dropped so that the file describes the run that continues.
    """

    def __init__(
        self, run_dir: str | os.PathLike, *, tensorboard: bool, resume_step: int | None = None
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tb = _open_tensorboard(self.path.parent) if tensorboard else None

    def _truncate_after(self, resume_step: int | None) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [ln for ln in lines if ln.strip() and _line_step(ln) <= (resume_step or 0)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``) and flush."""
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                if key != "step" and numeric:
                    self._tb.add_scalar(key, value, global_step=record["step"])

    def close(self) -> None:
        """Close the files."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def _open_tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL only, as documented
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl`` in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
