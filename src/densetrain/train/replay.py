"""Deterministic replay (Gemini's second SDC check): recompute one step's forward/backward from
the same inputs and compare the gradients, bit for bit on CPU (``faults.sdc_replay_tolerance``
0) or to a relative tolerance where the kernels are not deterministic.

Every ``faults.sdc_replay_interval`` steps the loop runs `replayed_step` instead of
``train_step``: the random generators are captured, forward/backward runs, the gradients are
copied, the generators restored and forward/backward runs again; then the step goes on
(clipping, the NaN guard, the update) with the second result. Each rank compares its own loss
and gradients; the ranks that found a difference are gathered and named. Under data parallel
the gradients are already reduced, so a corrupted rank makes every rank's gradients differ,
while its own loss (computed before any reduction) names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from densetrain.checkpoint import capture_rng_state, restore_rng_state
from densetrain.data.stream import Batch
from densetrain.optim.interface import TrainingOptimizer
from densetrain.parallel.model import LaidOutModel
from densetrain.train.step import StepOutput, finish_step


def _gradients(model: LaidOutModel, optimizer: TrainingOptimizer) -> list[tuple[str, torch.Tensor]]:
    named = [(n, p.grad) for n, p in model.module.named_parameters() if p.grad is not None]
    named += [(f"grad_shard.{i}", g) for i, g in enumerate(optimizer.grad_shards())]
    return [(n, g.to_local() if hasattr(g, "to_local") else g) for n, g in named]


def _differs(first: torch.Tensor, second: torch.Tensor, tolerance: float) -> bool:
    if tolerance == 0:
        return not torch.equal(first, second)
    scale = float(first.abs().max()) if first.numel() else 0.0
    return float((first - second).abs().max()) > tolerance * max(scale, 1e-30)


def compare_replay(first: list[tuple[str, torch.Tensor]], second: list[tuple[str, torch.Tensor]],
                   loss_pair: tuple[torch.Tensor, torch.Tensor], tolerance: float
                   ) -> list[str]:
    """Names of what differs between two computations of a step ("loss" and gradient names)."""
    differing = ["loss"] if _differs(loss_pair[0].reshape(1), loss_pair[1].reshape(1),
                                     tolerance) else []
    differing += [n for (n, a), (_, b) in zip(first, second, strict=True)
                  if _differs(a, b, tolerance)]
    return differing


def replay_message(step: int, differing: list[str]) -> str | None:
    """Gather every rank's differences; None when none differ, else a message naming ranks."""
    found = [differing]
    if dist.is_available() and dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, differing)
    bad = {r: names for r, names in enumerate(found) if names}
    if not bad:
        return None
    own_loss = [r for r, names in bad.items() if "loss" in names]
    details = "; ".join(f"rank {r}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                        for r, names in bad.items())
    suspects = own_loss or sorted(bad)
    return (f"silent data corruption: step {step} computed twice from the same inputs gave "
            f"different results ({details}); suspect rank(s) {suspects}")


def replayed_step(model: LaidOutModel, optimizer: TrainingOptimizer, batch: Batch, *,
                  micro_batch_size: int, grad_clip: float,
                  autocast: Callable[[], AbstractContextManager[None]], nan_policy: str,
                  step: int, tolerance: float) -> tuple[StepOutput, str | None]:
    """``train_step`` with its forward/backward run twice and compared; returns the step's
    output and the mismatch message (None when the two agree). Collective."""
    rng = capture_rng_state()
    loss_a, _ = model.forward_backward(batch, micro_batch_size=micro_batch_size,
                                       autocast=autocast)
    first = [(n, g.detach().clone()) for n, g in _gradients(model, optimizer)]
    optimizer.zero_grad()
    restore_rng_state(rng)
    loss_b, tokens = model.forward_backward(batch, micro_batch_size=micro_batch_size,
                                            autocast=autocast)
    differing = compare_replay(first, _gradients(model, optimizer), (loss_a, loss_b), tolerance)
    message = replay_message(step, differing)
    grad_norm = optimizer.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
    output = finish_step(optimizer, loss_b, grad_norm, tokens, nan_policy=nan_policy, step=step)
    return output, message
