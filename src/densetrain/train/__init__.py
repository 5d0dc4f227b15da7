"""densetrain.train: the thin trainer, the step function, metrics/MFU and callbacks.

``train(job) -> dict`` runs a `JobConfig` (resuming from the latest complete checkpoint) and
returns the summary also written to ``<run_dir>/summary.json``.

The names below import on first use (PEP 562 module ``__getattr__``), so that a submodule
without torch (``host_malloc``, which `densetrain train` uses before it restarts itself with
the tuned allocator) imports without the trainer: importing it used to load torch, DTensor and
DCP, 3.7 s spent again after the restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from densetrain.lazy import lazy_exports

if TYPE_CHECKING:
    from densetrain.train.callbacks import Callback, plot_loss_curve
    from densetrain.train.faults import RunFaultError, SilentDataCorruptionError
    from densetrain.train.metrics import (
        ACCELERATOR_PEAK_TFLOPS,
        MetricsWriter,
        accelerator_peak_flops,
        device_peak_flops,
        measure_cpu_peak_flops,
        mfu,
        read_metrics,
    )
    from densetrain.train.state import Progress, RunParts, StepReport
    from densetrain.train.step import (
        NonFiniteLossError,
        StepOutput,
        split_micro_batches,
        train_step,
    )
    from densetrain.train.trainer import train

_EXPORTS = {
    "ACCELERATOR_PEAK_TFLOPS": "densetrain.train.metrics",
    "Callback": "densetrain.train.callbacks",
    "MetricsWriter": "densetrain.train.metrics",
    "NonFiniteLossError": "densetrain.train.step",
    "Progress": "densetrain.train.state",
    "RunFaultError": "densetrain.train.faults",
    "RunParts": "densetrain.train.state",
    "SilentDataCorruptionError": "densetrain.train.faults",
    "StepOutput": "densetrain.train.step",
    "StepReport": "densetrain.train.state",
    "accelerator_peak_flops": "densetrain.train.metrics",
    "device_peak_flops": "densetrain.train.metrics",
    "measure_cpu_peak_flops": "densetrain.train.metrics",
    "mfu": "densetrain.train.metrics",
    "plot_loss_curve": "densetrain.train.callbacks",
    "read_metrics": "densetrain.train.metrics",
    "split_micro_batches": "densetrain.train.step",
    "train": "densetrain.train.trainer",
    "train_step": "densetrain.train.step",
}

__all__ = [
    "ACCELERATOR_PEAK_TFLOPS",
    "Callback",
    "MetricsWriter",
    "NonFiniteLossError",
    "Progress",
    "RunFaultError",
    "RunParts",
    "SilentDataCorruptionError",
    "StepOutput",
    "StepReport",
    "accelerator_peak_flops",
    "device_peak_flops",
    "measure_cpu_peak_flops",
    "mfu",
    "plot_loss_curve",
    "read_metrics",
    "split_micro_batches",
    "train",
    "train_step",
]


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
