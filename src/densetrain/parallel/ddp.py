"""Plain data parallel: every rank holds the whole model; gradients are averaged by all-reduce.

Uses torch's composable ``replicate`` (DistributedDataParallel underneath: bucketed all-reduce
overlapped with backward; Li et al. 2020). Unlike the ``DistributedDataParallel`` wrapper it
keeps the module's class and parameter names and initialises lazily at the first forward, so
it can be applied to a model built on the meta device before ``to_empty()``. Per step it moves
2Ψ elements per rank (a ring all-reduce is a reduce-scatter plus an all-gather; ZeRO paper §7).
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import replicate


def apply_ddp(model: nn.Module, mesh, *, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Replicate ``model`` over the 1-D ``mesh`` in place; returns ``model``.

    DDP synchronises gradients from hooks around ``forward``; the model's loss is part of its
    ``forward`` (``targets_BS``), so the chunked head runs under DDP unchanged.
    """
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False)
    return model
