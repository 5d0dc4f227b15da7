"""Plain data parallel: every rank holds the whole model; gradients are averaged by all-reduce.

Uses torch's composable ``replicate`` (DistributedDataParallel underneath: bucketed all-reduce
overlapped with backward; Li et al. 2020). Unlike the ``DistributedDataParallel`` wrapper it
keeps the module's class and parameter names and initialises lazily at the first forward, so
it can be applied to a model built on the meta device before ``to_empty()``. Per step it moves
2Ψ elements per rank (a ring all-reduce is a reduce-scatter plus an all-gather; ZeRO paper §7).
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed._composable import replicate
from torch.nn.parallel import DistributedDataParallel

# Buffers are not re-broadcast before each forward: every rank derives them from the config
# (RoPE tables), so they are identical. torch 2.13 names this ``forward_sync_buffers``
# (``broadcast_buffers`` is deprecated); older releases know only ``broadcast_buffers``. The
# sync at initialisation that the new name keeps copies equal values.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def apply_ddp(model: nn.Module, mesh, *, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Replicate ``model`` over the 1-D ``mesh`` in place; returns ``model``.

    DDP synchronises gradients from hooks around ``forward``; the model's loss is part of its
    ``forward`` (``targets_BS``), so the chunked head runs under DDP unchanged.
    """
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb, **_NO_FORWARD_BUFFER_SYNC)
    return model
