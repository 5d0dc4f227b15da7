"""One optimizer step: gradient accumulation over micro-batches, clipping, the NaN guard, update.

The step knows nothing about logging, evaluation or checkpoints (those are callbacks). It forces
exactly one host sync, the finiteness check of the loss and gradient norm, which decides whether
the update may happen (``nan_policy``); every other value stays on the device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch


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
    num_tokens: int
    """Target tokens this rank trained on in the step."""
    skipped: bool = False
    """True when a non-finite loss made the step skip its update (``nan_policy="skip"``)."""


LossFn = Callable[[torch.nn.Module, Any], Any]
"""``loss_fn(model, micro_batch) -> LossOutput`` (``.loss`` differentiable, ``.num_tokens``)."""


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction on non-final micro-batches.

    FSDP2 modules expose ``set_requires_gradient_sync``; DDP wrappers ``no_sync()``; anything else
    (one process) needs nothing.
    """
    if enabled:
        yield
        return
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def _valid_tokens(batch: Any, ignore_index: int) -> torch.Tensor:
    return (batch.targets != ignore_index).sum()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    *,
    loss_fn: LossFn,
    clip_grad_norm: Callable[[Any, float], torch.Tensor],
    grad_clip: float,
    autocast: Callable[[], AbstractContextManager[None]],
    nan_policy: str,
    step: int,
    ignore_index: int = -100,
    cp_group: Any = None,
) -> StepOutput:
    """Accumulate gradients over ``micro_batches``, clip, check finiteness, update.

    Each micro-batch's mean loss is weighted by its share of this rank's target tokens, so the
    accumulated gradient equals that of the mean over all tokens of the step. ``step`` (1-based,
    the step being taken) only names the step in errors. ``grad_clip`` <= 0 measures the norm
    without clipping.

    With context parallel (``cp_group``: the ranks sharing each sequence), the token count is
    summed over the group, so each rank's loss is weighted by its share of the whole sequences'
    tokens; the gradient is multiplied by the group size because the data-parallel reduction
    (FSDP over dp_shard × cp) averages over cp ranks where the loss needs their sum. The loss
    returned is that of the whole sequences (summed over the group).
    """
    token_counts = [_valid_tokens(b, ignore_index) for b in micro_batches]
    total_tokens = torch.stack(token_counts).sum()
    cp_size = 1
    if cp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total_tokens, group=cp_group)
        cp_size = dist.get_world_size(cp_group)
    total_tokens = total_tokens.clamp(min=1)
    loss_sum = torch.zeros((), device=micro_batches[0].inputs.device)
    last = len(micro_batches) - 1
    for index, (batch, count) in enumerate(zip(micro_batches, token_counts, strict=True)):
        with gradient_sync(model, enabled=index == last):
            with autocast():
                output = loss_fn(model, batch)
            weight = count.to(output.loss.dtype) / total_tokens
            (output.loss * (weight * cp_size)).backward()
        loss_sum = loss_sum + output.loss.detach().float() * weight
    if cp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(loss_sum, group=cp_group)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = clip_grad_norm(params, grad_clip if grad_clip > 0 else math.inf)
    return finish_step(optimizer, loss_sum, grad_norm, total_tokens, nan_policy=nan_policy,
                       step=step)


def finish_step(
    optimizer: Any,
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
        optimizer.zero_grad(set_to_none=True)
        if nan_policy == "stop":
            raise NonFiniteLossError(
                f"step {step}: non-finite training loss ({loss.item()}) or gradient norm "
                f"({grad_norm.item()}); the run stops before any update or checkpoint. Lower "
                "optim.lr, set optim.grad_clip, or use training.nan_policy='skip'"
            )
        return StepOutput(loss=loss, grad_norm=grad_norm, num_tokens=0, skipped=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss=loss, grad_norm=grad_norm, num_tokens=int(total_tokens))


def split_micro_batches(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a rank's batch (a dataclass of [b, S] tensors or None) into micro-batches."""
    rows = batch.inputs.shape[0]
    if rows % micro_batch_size != 0:
        raise ValueError(
            f"the rank's batch of {rows} sequences is not divisible by training.micro_batch_size="
            f"{micro_batch_size}"
        )
    if rows == micro_batch_size:
        return [batch]
    fields = {k: v for k, v in vars(batch).items()}
    pieces = []
    for start in range(0, rows, micro_batch_size):
        chunk = {
            k: (v[start : start + micro_batch_size] if isinstance(v, torch.Tensor) else v)
            for k, v in fields.items()
        }
        pieces.append(type(batch)(**chunk))
    return pieces
