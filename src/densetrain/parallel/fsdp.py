"""ZeRO-3 / FSDP and HSDP through FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each transformer block is its own FSDP unit (its parameters are all-gathered just before it runs
and freed after), then the root module takes the embeddings, final norm and output head. On a
1-D mesh this is ZeRO-3 (Rajbhandari et al. 2020); on a 2-D (dp_replicate, dp_shard) mesh it is
HSDP: sharded within a group, replicated across groups. ZeRO-1/2 live in ``parallel/zero.py``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` over ``mesh`` (1-D: FSDP; 2-D replicate × shard: HSDP) block by block.

    ``param_dtype`` is the compute dtype of gathered parameters (None keeps fp32); gradients are
    reduced in ``reduce_dtype``. ``cpu_offload`` keeps the sharded parameters, gradients and
    optimizer states in CPU memory (the optimizer step then runs on the CPU).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload: OffloadPolicy = (
        # pinned host memory needs a GPU; on a CPU-only run offload keeps plain host tensors
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    layers = getattr(model, "layers", None)
    if layers is not None:
        names = list(layers.keys())
        for index, name in enumerate(names):
            # The last block's parameters are needed again at once by backward: keep them.
            reshard = reshard_after_forward and index < len(names) - 1
            fully_shard(
                layers[name], mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                reshard_after_forward=reshard,
            )
    fully_shard(
        model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
        reshard_after_forward=reshard_after_forward,
    )
    return model
