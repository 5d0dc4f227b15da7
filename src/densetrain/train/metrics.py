"""Throughput and model FLOPs utilisation (MFU), the peak it divides by, the metrics JSONL.

MFU = achieved model FLOP/s ÷ peak FLOP/s of the devices (Chowdhery et al. 2022, PaLM §4.1 and
Appendix B), with model FLOPs per token from `densetrain.models.sizing.flops_per_token_palm`
(6N + 12·L·H·Q·T: rematerialisation is not counted). Peaks of accelerators come from a table of
vendor datasheet dense (non-sparse) numbers; on CPU the peak is measured with a short matmul
probe (best of several spaced runs), because CPU peaks depend on core count, clocks and the
instruction set in use (a bf16 run on a CPU whose bf16 matmuls are slower than its fp32 ones
divides by the fp32 rate: bf16 is no faster mode there); ``logging.peak_tflops`` pins it
instead. Each run says which it used. A probed peak is probed again when MFU against it would
exceed 100% (`RunPeak`), and the run says at which step the peak it uses was probed.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from densetrain.train.jsonl import drop_torn_tail, read_json_lines

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

CPU_PROBE_RUNS = 5
"""Timed runs of the CPU peak probe; the best one is the peak."""

MFU_WARNING_THRESHOLD = 1.0
"""MFU above this (100%) means the peak it divides by is too low."""


def accelerator_table_key(device_name: str) -> str | None:
    """The `ACCELERATOR_PEAK_TFLOPS` key of a device name, or None if unknown.

    The longest table key contained in ``device_name`` wins ("NVIDIA H100 80GB HBM3" → "H100").
    """
    matches = [key for key in ACCELERATOR_PEAK_TFLOPS if key.lower() in device_name.lower()]
    return max(matches, key=len) if matches else None


def accelerator_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a named accelerator for ``dtype`` ("bf16"/"fp32"), or None if unknown."""
    key = accelerator_table_key(device_name)
    if key is None:
        return None
    bf16, fp32 = ACCELERATOR_PEAK_TFLOPS[key]
    return (bf16 if dtype == "bf16" else fp32) * 1e12


PROBE_LARGER_MAX_S = 0.025
"""The longest one matmul of the doubled probe size may take for `measure_cpu_peak_flops` to
probe that size as well."""


def measure_cpu_peak_flops(dtype: str = "fp32", *, size: int = 1024, runs: int = CPU_PROBE_RUNS,
                           seconds_per_run: float = 0.06, pause_s: float = 0.02,
                           fresh: bool = False) -> float:
    """Best sustained FLOP/s of square matmuls on this CPU with the current thread count, on
    the library that densetrain's layers use for them (`densetrain.models.linear`).

    ``runs`` short runs, each timing back-to-back ``size``² matmuls for about
    ``seconds_per_run`` as one rate, with a pause between runs; the best run is the peak. One
    run on a machine shared with other work reads low when a neighbour is busy at that moment
    (and MFU against it then reads high); the best of several spaced runs is the rate this CPU
    reaches when it is free. Cached per (dtype, threads). ``fresh`` measures again and replaces
    the cached figure (a benchmark's probe after its runs).

    ``size`` 1024 is MKL's and AVX-512 oneDNN's peak territory, but not AMX's: on 2 cores of an
    AMX Xeon, bf16, 1,024² runs at 1.27 TFLOP/s and 2,048² at 2.25 (3,072²: 2.14; fp32 0.34 at
    every size). So where a matmul of twice ``size`` takes at most `PROBE_LARGER_MAX_S` at the
    first rate, that size is probed too and the better rate is the peak; slow modes (fp32 on
    2 cores, bf16 without bf16 instructions) keep the short probe.
    """
    threads = torch.get_num_threads()
    key = (dtype, threads)
    if key in _CPU_PEAK_CACHE and not fresh:
        return _CPU_PEAK_CACHE[key]
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    # Probed as a linear layer's forward multiplies, a @ bᵀ, through densetrain's own `linear`,
    # i.e. on the library its layers use. fp32: oneDNN on AVX-512 AMD CPUs, where MKL's sgemm
    # runs AVX2 code at about half the rate (a torch.mm probe would halve the ceiling). bf16:
    # what autocast runs; on a CPU without oneDNN bf16 kernels, torch.mm of two row-major bf16
    # matrices takes a slower loop than the layers' own matmuls (2 AMD EPYC cores, AVX2, 1024³:
    # 0.0008 against 0.016 TFLOP/s), which would read as an MFU of several hundred percent.
    peak = _probe_square_matmuls(size, torch_dtype, runs, seconds_per_run, pause_s)
    if 2.0 * (2 * size) ** 3 / peak <= PROBE_LARGER_MAX_S:
        peak = max(peak, _probe_square_matmuls(2 * size, torch_dtype, runs, seconds_per_run,
                                               pause_s))
    _CPU_PEAK_CACHE[key] = peak
    return peak


def _probe_square_matmuls(size: int, torch_dtype: torch.dtype, runs: int,
                          seconds_per_run: float, pause_s: float) -> float:
    """Best FLOP/s of ``runs`` timed runs of back-to-back ``size``² `linear` matmuls."""
    from densetrain.models.linear import linear
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(torch_dtype)
    b = torch.randn(size, size, generator=gen).to(torch_dtype)
    linear(a, b)  # warm-up (thread pool, kernel selection)
    best_rate = 0.0
    for run in range(runs):
        if run:
            time.sleep(pause_s)
        matmuls = 0
        start = time.perf_counter()
        while matmuls < 2 or time.perf_counter() - start < seconds_per_run:
            linear(a, b)
            matmuls += 1
        best_rate = max(best_rate, matmuls / (time.perf_counter() - start))
    return 2.0 * size**3 * best_rate


def device_peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` for ``dtype`` and where the figure came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = accelerator_table_key(name)
        if key is not None:
            peak = accelerator_peak_flops(name, dtype)
            return peak, f"device table: {key} {dtype} ({name})"
        return math.nan, (f"unknown accelerator {name}: pin logging.peak_tflops (or add it to "
                          "ACCELERATOR_PEAK_TFLOPS)")
    if device.type == "cpu":
        threads = torch.get_num_threads()
        slower = cpu_bf16_shortfall() if dtype == "bf16" else None
        if slower is not None:  # the machine's peak is its fp32 rate: bf16 is no faster mode here
            return slower[1], (f"probed best of {CPU_PROBE_RUNS} fp32 matmul runs, {threads} "
                               f"threads; this CPU's bf16 matmuls are slower "
                               f"({slower[0] / 1e12:.3g} TFLOP/s)")
        peak = measure_cpu_peak_flops(dtype)
        return peak, f"probed best of {CPU_PROBE_RUNS} {dtype} matmul runs, {threads} threads"
    return math.nan, f"no peak known for device type {device.type}: pin logging.peak_tflops"


def cpu_bf16_shortfall() -> tuple[float, float] | None:
    """``(bf16, fp32)`` probed FLOP/s of this CPU when its bf16 matmuls are the slower, else
    None. CPUs without bf16 matmul instructions (AVX512-BF16, AMX; e.g. AVX2-only x86) convert
    or loop in bf16, so bf16 autocast there costs speed instead of buying it."""
    bf16, fp32 = measure_cpu_peak_flops("bf16"), measure_cpu_peak_flops("fp32")
    return (bf16, fp32) if bf16 < fp32 else None


def cpu_bf16_warning(device: torch.device, dtype_field: str) -> str | None:
    """The start-up warning of a CPU run in bf16 (``training.dtype`` ``bf16``, or ``float8``,
    whose other layers run in bf16) on a CPU whose bf16 matmuls are slower than its fp32 ones;
    None elsewhere."""
    if device.type != "cpu" or dtype_field not in ("bf16", "float8"):
        return None
    slower = cpu_bf16_shortfall()
    if slower is None:
        return None
    bf16, fp32 = slower
    return (f"warning: training.dtype={dtype_field} is slower than fp32 on this CPU: a bf16 "
            f"linear layer's matmul ran at {bf16 / 1e12:.3g} TFLOP/s against "
            f"{fp32 / 1e12:.3g} for fp32 ({fp32 / bf16:.1f}x slower; CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}: bf16 is fast on CPUs with AVX512-BF16 "
            "or AMX). Use --training.dtype=fp32 here for speed; bf16 still trains correctly.")


FLOAT8_TENSOR_CORES = (8, 9)
"""The first CUDA compute capability with float8 matmul units (Ada, Hopper and later)."""


def float8_emulation_warning(device: torch.device, dtype_field: str,
                             capability: tuple[int, int] | None = None) -> str | None:
    """The start-up warning of a ``training.dtype=float8`` run where float8 matmuls are
    emulated (a CPU, a GPU of compute capability below 8.9): correct, but slower than bf16, so
    a run that chose float8 for speed hears of it at once. ``capability`` is the GPU's
    (``torch.cuda.get_device_capability``), read here when not given; None elsewhere."""
    if dtype_field != "float8" or device.type not in ("cpu", "cuda"):
        return None
    if device.type == "cuda":
        capability = capability or torch.cuda.get_device_capability(device)
        if tuple(capability) >= FLOAT8_TENSOR_CORES:
            return None
        where = f"this GPU (compute capability {capability[0]}.{capability[1]}) has"
    else:
        where = "a CPU has"
    return (f"warning: training.dtype=float8 emulates its float8 matmuls here: {where} no "
            "float8 matmul units (CUDA compute capability 8.9+: L40S, H100, H200, B200), so the "
            "run is correct but slower than --training.dtype=bf16")


PINNED_PEAK_SOURCE = "pinned by logging.peak_tflops"


def run_peak_flops(device: torch.device, dtype: str, pinned_tflops: float) -> tuple[float, str]:
    """The peak FLOP/s of one device that the run's MFU divides by, and its source: the
    pinned ``logging.peak_tflops`` when > 0, else `device_peak_flops`."""
    if pinned_tflops > 0:
        return pinned_tflops * 1e12, PINNED_PEAK_SOURCE
    return device_peak_flops(device, dtype)


MAX_REPROBES = 3
"""Re-probes of the peak a run makes at most (each a fraction of a second on a CPU)."""


class RunPeak:
    """The peak FLOP/s of one device that a run's MFU divides by, re-measured when it reads low.

    A probe taken while other work loads a shared machine reads low, and MFU against it reads
    above 100%. So when `mfu` would exceed 100% and the figure came from a probe (``reprobe`` is
    given: a CPU run without ``logging.peak_tflops``), the peak is probed again, up to
    `MAX_REPROBES` times in a run, and the best reading is kept; ``source`` then names the step
    whose probe it is. A pinned or datasheet peak is never re-probed.
    """

    def __init__(self, flops: float, source: str, *,
                 reprobe: Callable[[], float] | None = None) -> None:
        self.flops = flops
        self.base_source = source
        self.reprobe = reprobe
        self.reprobes = 0
        self.step: int | None = None
        """The step whose re-probe gave ``flops``; None: the probe (or figure) at start."""

    @property
    def source(self) -> str:
        """Where ``flops`` came from, and when it was probed."""
        if self.step is None:
            return self.base_source if self.reprobe is None else f"{self.base_source}, at start"
        return f"{self.base_source}, re-probed at step {self.step}"

    def describe(self) -> str:
        """``peak <x> TFLOP/s per device (<source>)``."""
        return f"peak {self.flops / 1e12:.3g} TFLOP/s per device ({self.source})"

    def mfu(self, tokens_per_s: float, flops_per_token: float, num_devices: int, *,
            step: int) -> float:
        """`mfu` against this peak, re-probing first while it would exceed 100% and re-probes
        are left (see the class docstring)."""
        value = mfu(tokens_per_s, flops_per_token, self.flops, num_devices)
        while (value > MFU_WARNING_THRESHOLD and self.reprobe is not None
               and self.reprobes < MAX_REPROBES):
            self.reprobes += 1
            probed = self.reprobe()
            if probed > self.flops:
                self.flops, self.step = probed, step
            value = mfu(tokens_per_s, flops_per_token, self.flops, num_devices)
        return value


def run_peak(device: torch.device, dtype: str, pinned_tflops: float) -> RunPeak:
    """`run_peak_flops` as a `RunPeak`, able to re-probe when it is a CPU probe."""
    flops, source = run_peak_flops(device, dtype, pinned_tflops)
    if device.type != "cpu" or pinned_tflops > 0:
        return RunPeak(flops, source)
    slower = cpu_bf16_shortfall() if dtype == "bf16" else None
    probe_dtype = "fp32" if slower is not None else dtype
    return RunPeak(flops, source,
                   reprobe=lambda: measure_cpu_peak_flops(probe_dtype, fresh=True))


def mfu_warning(mfu_value: float, peak_flops: float, peak_source: str) -> str | None:
    """The warning for an MFU above 100% (the peak it divides by is too low), else None."""
    if not (mfu_value > MFU_WARNING_THRESHOLD):  # NaN: no warning
        return None
    return (f"MFU {100 * mfu_value:.0f}% is above 100%, so the peak it divides by, "
            f"{peak_flops / 1e12:.3g} TFLOP/s per device ({peak_source}), is too low for this "
            "machine; set --logging.peak_tflops to the device's real peak")


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of ``num_devices`` devices."""
    if not peak_flops or math.isnan(peak_flops) or num_devices <= 0:
        return math.nan
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and hands the same record
    to each sink (TensorBoard, W&B: `densetrain.train.loggers`).

    On resume, lines of steps after ``resume_step`` (written by the interrupted run after its
    last checkpoint) are dropped so that the file describes the run that continues; `rewind`
    does the same after a rollback.
    """

    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int | None = None,
                 sinks: Sequence[Any] = ()) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks = list(sinks)
        self._file = None
        self._open(resume_step)

    def _open(self, resume_step: int | None) -> None:
        if self.path.exists():
            records, torn_at = read_json_lines(self.path, "metrics record", _check_record)
            if torn_at is not None:
                drop_torn_tail(self.path, torn_at)
            kept = [r for r in records if r["step"] <= (resume_step or 0)]
            if len(kept) < len(records):
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in kept),
                               encoding="utf-8")
                os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``), flush, and pass it to the sinks."""
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.write(record)

    def rewind(self, step: int) -> None:
        """Drop the records after ``step`` (a rollback): from the file and in the sinks."""
        self._file.close()
        self._open(step)
        for sink in self.sinks:
            sink.rewind(step)

    def close(self) -> None:
        """Close the file and the sinks."""
        self._file.close()
        for sink in self.sinks:
            sink.close()


def _check_record(record: dict[str, Any]) -> None:
    int(record["step"])


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl`` in order.

    A torn last line (the process was killed or the disk filled during its write) is left
    out; an unreadable line before the last one raises ``ValueError`` naming ``file:line``.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return read_json_lines(path, "metrics record", _check_record)[0]
