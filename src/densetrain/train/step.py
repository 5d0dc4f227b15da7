"""One optimizer step: forward/backward of the rank's batch, clipping, the NaN guard, update.

The step knows nothing about logging, evaluation or checkpoints (those are callbacks), nor about
the layout: the `LaidOutModel` runs forward and backward (gradient accumulation or the pipeline
schedule) and the `TrainingOptimizer` clips and updates. It forces exactly one host sync, the
finiteness check of the loss and gradient norm that decides whether the update may happen
(``nan_policy``); every other value stays on the device (a test counts the syncs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from densetrain.data.stream import Batch
from densetrain.optim.interface import TrainingOptimizer
from densetrain.parallel.model import LaidOutModel, split_micro_batches

__all__ = ["NonFiniteLossError", "StepOutput", "finish_step", "split_micro_batches",
           "train_step"]


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm of a step was NaN or infinite (``nan_policy="stop"``)."""


@dataclass(kw_only=True)
class StepOutput:
    """What a step returns; tensors stay on the device until a logger reads them."""

    loss: torch.Tensor
    """Token-weighted mean training loss of the step on this rank's sequences (detached; with
    context or pipeline parallel, of the whole sequences its group shares)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    num_tokens: torch.Tensor
    """Target tokens this rank trained on in the step (0 when skipped); on the device."""
    skipped: bool = False
    """True when a non-finite loss made the step skip its update (``nan_policy="skip"``)."""


def train_step(
    model: LaidOutModel,
    optimizer: TrainingOptimizer,
    batch: Batch,
    *,
    micro_batch_size: int,
    grad_clip: float,
    autocast: Callable[[], AbstractContextManager[None]],
    nan_policy: str,
    step: int,
) -> StepOutput:
    """Forward/backward over the rank's prepared ``batch``, clip, check finiteness, update.

    ``step`` (1-based, the step being taken) only names the step in errors. ``grad_clip`` <= 0
    measures the norm without clipping.
    """
    loss, total_tokens = model.forward_backward(batch, micro_batch_size=micro_batch_size,
                                                autocast=autocast)
    grad_norm = optimizer.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
    return finish_step(optimizer, loss, grad_norm, total_tokens, nan_policy=nan_policy, step=step)


def finish_step(
    optimizer: TrainingOptimizer,
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    total_tokens: torch.Tensor,
    *,
    nan_policy: str,
    step: int,
) -> StepOutput:
    """The NaN guard and the update, once gradients are accumulated and clipped.

    The finiteness check of ``loss`` and ``grad_norm`` is the step's one host sync; a non-finite
    step drops its gradients and stops (``nan_policy="stop"``) or skips the update.
    """
    finite = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))  # the one host sync
    if not finite:
        optimizer.zero_grad()
        if nan_policy == "stop":
            raise NonFiniteLossError(
                f"step {step}: non-finite training loss ({loss.item()}) or gradient norm "
                f"({grad_norm.item()}); the run stops before any update or checkpoint. Lower "
                "optim.lr, set optim.grad_clip, or use training.nan_policy='skip'"
            )
        return StepOutput(loss=loss, grad_norm=grad_norm, num_tokens=torch.zeros_like(total_tokens),
                          skipped=True)
    optimizer.step()
    optimizer.zero_grad()
    return StepOutput(loss=loss, grad_norm=grad_norm, num_tokens=total_tokens)
