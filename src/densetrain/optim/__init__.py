"""densetrain.optim: optimizers, parameter groups, LR and batch-size schedules, clipping.

The configs import at once; the torch parts import on first use (PEP 562 module
``__getattr__``), so that loading a job config never imports torch. The function
``param_groups`` is imported from its module, ``densetrain.optim.param_groups`` (the package
attribute of that name is the submodule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from densetrain.lazy import lazy_exports
from densetrain.optim.config import OptimConfig, ScheduleConfig

if TYPE_CHECKING:
    from densetrain.optim.adafactor import Adafactor
    from densetrain.optim.clipping import clip_grad_norm_
    from densetrain.optim.optimizers import build_optimizer
    from densetrain.optim.param_groups import classify_parameters
    from densetrain.optim.schedules import (
        BatchSizeSchedule,
        LRScheduler,
        batch_size_at,
        build_lr_scheduler,
        lr_at,
        wsd_decay_steps,
    )

_TORCH_EXPORTS = {
    "Adafactor": "adafactor",
    "clip_grad_norm_": "clipping",
    "build_optimizer": "optimizers",
    "classify_parameters": "param_groups",
    "BatchSizeSchedule": "schedules",
    "LRScheduler": "schedules",
    "batch_size_at": "schedules",
    "build_lr_scheduler": "schedules",
    "lr_at": "schedules",
    "wsd_decay_steps": "schedules",
}

__all__ = [
    "Adafactor",
    "BatchSizeSchedule",
    "LRScheduler",
    "OptimConfig",
    "ScheduleConfig",
    "batch_size_at",
    "build_lr_scheduler",
    "build_optimizer",
    "classify_parameters",
    "clip_grad_norm_",
    "lr_at",
    "wsd_decay_steps",
]


__getattr__ = lazy_exports(__name__, _TORCH_EXPORTS, globals())
