"""densetrain.optim: optimizers, parameter groups, LR and batch-size schedules, clipping."""

from densetrain.optim.adafactor import Adafactor
from densetrain.optim.clipping import clip_grad_norm_
from densetrain.optim.config import OptimConfig, ScheduleConfig
from densetrain.optim.optimizers import build_optimizer
from densetrain.optim.param_groups import classify_parameters, param_groups
from densetrain.optim.schedules import (
    BatchSizeSchedule,
    LRScheduler,
    batch_size_at,
    build_lr_scheduler,
    lr_at,
    wsd_decay_steps,
)

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
    "param_groups",
    "wsd_decay_steps",
]
