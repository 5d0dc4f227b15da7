"""Global gradient-norm clipping for plain tensors and DTensors (FSDP2 / tensor parallel).

``torch.nn.utils.get_total_norm`` reduces DTensor gradients correctly (the per-tensor norms are
partial over the shards and the result is a DTensor); the total is then made a plain tensor with
``full_tensor()`` so that every rank scales by the same factor. Pipeline stages hold disjoint
parameters, so their norms are combined with an all-reduce over the pipeline group; a parameter
another rank of that group also holds (the last stage's copy of a tied embedding) is marked
with `mark_counted_elsewhere` and left out of the norm here (it is still clipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_COUNTED_ELSEWHERE = "_densetrain_norm_counted_elsewhere"


def mark_counted_elsewhere(param: torch.Tensor) -> None:
    """Leave ``param`` out of the gradient norm of this rank: its gradient equals that of a
    parameter another rank of the pp group holds and counts (a copy of a shared matrix)."""
    setattr(param, _COUNTED_ELSEWHERE, True)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    error_if_nonfinite: bool = False,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm before clipping (a plain tensor, equal on every rank). ``max_norm``
    of 0 measures without clipping (``optim.grad_clip = 0``). Non-finite norms leave gradients
    unscaled by torch's rule (and raise with ``error_if_nonfinite``).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    # Tensor parallel without sequence parallel leaves the norms' weights plain (replicated)
    # tensors beside DTensor shards, or, under FSDP, DTensors on the data-parallel mesh beside
    # shards on the data-parallel x tensor-parallel one; torch's foreach norm refuses a list
    # that mixes kinds or meshes, so each group is reduced on its own and the totals combined.
    measured = [p for p in params if not getattr(p, _COUNTED_ELSEWHERE, False)]
    totals = []
    for grads in _by_mesh([p.grad for p in measured]):
        part = torch.nn.utils.get_total_norm(
            grads, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )
        totals.append(part.full_tensor() if isinstance(part, DTensor) else part)
    if not totals:  # only copies counted on other ranks: this rank adds nothing
        grad = params[0].grad
        total = torch.zeros((), device=grad.device, dtype=torch.float32)
    elif math.isinf(norm_type):
        total = totals[0]
        for part in totals[1:]:
            total = torch.maximum(total, part.to(total.device))
    elif len(totals) == 1:
        total = totals[0]
    else:
        total = sum(part.to(totals[0].device) ** norm_type for part in totals) ** (
            1.0 / norm_type)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    if 0 < max_norm < math.inf:  # an infinite bound would multiply every gradient by 1
        by_grad = {id(p.grad): p for p in params}
        for grads in _by_mesh([p.grad for p in params]):
            group = [by_grad[id(g)] for g in grads]
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` grouped so that each group is all plain tensors or all DTensors of one mesh,
    in first-seen order."""
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    return list(groups.values())
