"""The run's state, split by lifetime.

- `RunParts`: what was built once from the job (the laid-out model, the optimizer, schedules,
  data, device, the mesh, paths and sizes, and the checkpoint session over them), and the
  frozen `RunSettings` the loop reads. Never replaced during the run. What the run learns as
  it goes is not a field: the fault record is an entry of the checkpoint session, filled by
  the `FaultGuard` (train/faults.py). The one exception is ``peak``: the
  `RunPeak` that MFU divides by is re-probed in place when it reads low.
- `Progress`: the checkpointed counters (``TrainerCounters``: optimizer steps taken and tokens
  consumed), restored on resume.
- `StepReport`: what one step produced (loss, gradient norm, learning rate, timings and, on
  evaluation steps, the validation loss). Callbacks read it; none writes into it, so they do
  not depend on each other's order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from densetrain.checkpoint import CheckpointSession, TrainerCounters
from densetrain.data.bundle import DataBundle
from densetrain.models.config import ModelConfig
from densetrain.optim.interface import TrainingOptimizer
from densetrain.optim.schedules import BatchSizeSchedule, LRScheduler
from densetrain.parallel.mesh import ParallelMesh
from densetrain.parallel.model import LaidOutModel
from densetrain.train.fault_record import FaultRecord
from densetrain.train.metrics import RunPeak

Progress = TrainerCounters
"""The checkpointed progress of a run: ``step`` (optimizer steps taken) and ``tokens``."""


@dataclass(kw_only=True, frozen=True)
class ModelSizes:
    """Counts of the model (from ``models.sizing``) that MFU and the summary use."""

    params: int
    non_embedding_params: int
    flops_per_token: float


@dataclass(kw_only=True, frozen=True)
class RunSettings:
    """The resolved job's values that the loop, evaluation and callbacks read, fixed for the
    run (from the job `build_run` resolved; no config section is reachable from `RunParts`,
    so nothing can change one mid-run)."""

    steps: int
    """``training.steps``: the step the run ends at."""
    global_batch_size: int
    """Sequences per step at the end of any batch ramp (``training.global_batch_size``)."""
    micro_batch_size: int
    """Sequences per forward/backward on one data-parallel rank (resolved, never 0)."""
    seq_len: int
    grad_clip: float
    nan_policy: str
    config_toml: str
    """The resolved job as TOML: stored in each checkpoint, compared on resume, logged."""


@dataclass(kw_only=True)
class RunParts:
    """Everything built once for a run (see the module docstring)."""

    model: LaidOutModel
    model_cfg: ModelConfig
    optimizer: TrainingOptimizer
    scheduler: LRScheduler
    batch_schedule: BatchSizeSchedule
    data: DataBundle
    device: torch.device
    autocast: Callable[[], AbstractContextManager[None]]
    pmesh: ParallelMesh
    settings: RunSettings
    rank: int
    world_size: int
    run_dir: Path
    checkpoint_dir: Path | str
    """A local directory, or a ``scheme://`` URL string (checkpoint/objstore.py)."""
    sizes: ModelSizes
    peak: RunPeak
    """The peak FLOP/s of one device that MFU divides by (re-probed when it reads low)."""
    checkpoints: CheckpointSession
    """The run's checkpoints over these parts (schema, resume, saves, rollback), built with
    them by `build_run`; the loop, the `Checkpointer` and the `FaultGuard` use it."""

    @property
    def fault_record(self) -> FaultRecord:
        """The run's skipped steps, rollbacks and skipped data ranges: the record the
        `FaultGuard` fills and the checkpoint session saves (train/faults.py)."""
        return self.checkpoints.faults

    @property
    def peak_flops(self) -> float:
        """The peak FLOP/s of one device that MFU divides by now."""
        return self.peak.flops

    @property
    def peak_source(self) -> str:
        """Where `peak_flops` came from (and at which step it was probed)."""
        return self.peak.source

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the one that prints and writes run files)."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel degree (ranks that read different sequences)."""
        return self.pmesh.dims.dp_size


@dataclass(kw_only=True)
class StepReport:
    """What one optimizer step produced; tensors stay on the device until a reader needs them."""

    step: int
    """Optimizer steps taken, this one included."""
    total_steps: int
    loss: torch.Tensor
    """Token-weighted mean training loss of the step (over the whole sequences of the group)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    skipped: bool
    """True when a non-finite loss made the step skip its update (``nan_policy="skip"``)."""
    lr: float
    tokens: int
    """Training tokens consumed by the run so far (all processes, since step 0)."""
    process_tokens: int
    """Training tokens this process has trained on (since it started)."""
    process_train_seconds: float
    """Seconds this process spent in training steps."""
    step_seconds: float
    eval: dict[str, float] = field(default_factory=dict)
    """``val_loss`` and ``val_ppl`` on evaluation steps, else empty."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """The ranks named stragglers now (`train.stragglers`): rank, host, factor, since_step."""

    @property
    def is_last(self) -> bool:
        """The run's final step."""
        return self.step >= self.total_steps
