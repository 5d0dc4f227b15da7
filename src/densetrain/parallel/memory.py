"""Bytes each rank holds for parameters, gradients and optimizer states.

A DTensor (FSDP2 shards, TP shards) counts only its local shard; tensors that share storage are
counted once. These numbers are what the ZeRO paper's model-state formulas predict per rank
(Rajbhandari et al. 2020, §5: with N ranks and Ψ parameters, ZeRO-1 holds the full parameters and
gradients and 1/N of the optimizer states, ZeRO-2 also 1/N of the gradients, ZeRO-3 1/N of all).
The trainer logs them in a run's first metrics record.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from densetrain.optim.interface import TrainingOptimizer


@dataclass(kw_only=True, frozen=True)
class RankMemory:
    """Model-state bytes held by one rank."""

    param_bytes: int
    grad_bytes: int
    optim_bytes: int

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (the local shard of a DTensor, else ``t``)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        local = local_tensor(t)
        if local.device.type == "meta":
            continue
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if key in seen and local.numel() > 0:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def rank_memory(
    params: Iterable[torch.Tensor], optimizer: TrainingOptimizer | None = None
) -> RankMemory:
    """Count the bytes this rank holds for ``params``, their ``.grad`` and ``optimizer`` state.

    The optimizer's own gradient shards (ZeRO-2) count as gradients and its master chunks
    (ZeRO-1/2) as optimizer states (the paper counts master weights in the K·Ψ of §3.1).
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    optim_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            optim_tensors.extend(
                v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"
            )
        grads.extend(optimizer.grad_shards())
        optim_tensors.extend(optimizer.optimizer_tensors())
    return RankMemory(
        param_bytes=_bytes(params), grad_bytes=_bytes(grads), optim_bytes=_bytes(optim_tensors)
    )
