"""A process that is rank ``rank`` of ``world_size`` without the other ranks.

PyTorch's fake process-group backend (``torch.testing._internal.distributed.fake_pg``) accepts
every collective and returns at once without moving data, so the real mesh, parallelize, FSDP,
tensor and pipeline code run unchanged on one process as any rank of any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from densetrain.errors import UserError


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """Initialise the default process group as ``rank`` of ``world_size`` on the fake backend
    (destroyed on exit). Refuses a process that is already part of a real group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise UserError(
            f"rank {rank} is outside a world of {world_size} ranks (0..{world_size - 1})")
    if dist.is_initialized():
        raise RuntimeError(
            "a dry run needs its own process: a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    restore = _mesh_coordinates_outside_fake_mode()
    try:
        yield
    finally:
        restore()
        dist.destroy_process_group()


def _mesh_coordinates_outside_fake_mode():
    """Let a ``DeviceMesh`` made under ``FakeTensorMode`` (FSDP2 makes one over a tensor-parallel
    mesh) find its rank's coordinates: torch computes them with a ``nonzero`` over the rank
    table, which a fake tensor cannot answer. The table is real, so the lookup runs with fake
    mode set aside. Returns the function that undoes it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._compute_coordinates_from_mesh

    def coordinates(mesh_tensor, rank):
        with unset_fake_temporarily():
            return original(mesh_tensor, rank)

    DeviceMesh._compute_coordinates_from_mesh = staticmethod(coordinates)

    def restore() -> None:
        DeviceMesh._compute_coordinates_from_mesh = staticmethod(original)

    return restore
