"""densetrain.train: the thin trainer, the step function, metrics/MFU and callbacks.

``train(job) -> dict`` runs a `JobConfig` (resuming from the latest complete checkpoint) and
returns the summary also written to ``<run_dir>/summary.json``.
"""

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
from densetrain.train.step import NonFiniteLossError, StepOutput, split_micro_batches, train_step
from densetrain.train.trainer import train

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
