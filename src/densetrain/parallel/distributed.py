"""Process-group setup from the torchrun environment, and errors that name the rank and step.

torchrun (single node: ``--standalone``; multi-node: ``--rdzv-backend=c10d``) sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address; `init_distributed` reads them and
starts NCCL on CUDA or gloo on CPU with a collective timeout, so a rank that dies or hangs makes
the others fail after ``timeout_s`` instead of waiting forever.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(kw_only=True, frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def device_type(self) -> str:
        """"cuda" or "cpu" (what ``DeviceMesh`` wants)."""
        return self.device.type


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the training step."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def env_world_size() -> int:
    """The world size torchrun announces (``WORLD_SIZE``; 1 without torchrun), read without
    starting a process group, so that a layout is checked before any rank waits on another.
    A process group already initialised (by a test helper) gives its own size."""
    if dist.is_initialized():
        return dist.get_world_size()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world_size}")
    return world_size


def env_local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The ranks on this host as torchrun announces them (``LOCAL_WORLD_SIZE``; 1 without
    torchrun), from ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("LOCAL_WORLD_SIZE") or "1"
    try:
        local = int(raw)
    except ValueError:
        local = 0
    if local < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE must be an integer >= 1 (the "
                         f"ranks on this host), got {raw!r}")
    return local


def backend_for(device_type: str) -> str:
    """NCCL for CUDA devices, gloo for CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(*, timeout_s: float = 600.0, device_type: str | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment (no-op on one process).

    ``device_type`` defaults to "cuda" when a GPU is visible, else "cpu". If a process group is
    already initialised (e.g. by a test helper) it is reused.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return DistInfo(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
            device=device,
        )
    if world_size > 1:
        dist.init_process_group(
            backend=backend_for(device_type),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device_type == "cuda" else None,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def destroy_distributed() -> None:
    """Tear down the default process group if one is running."""
    if dist.is_initialized():
        dist.destroy_process_group()


# gloo reports timeouts and lost peers as plain RuntimeErrors raised from its C++ sources; c10d's
# own errors are DistError subclasses. Other RuntimeErrors of a step (a shape bug, an op on mixed
# tensor kinds) must keep their own message.
_BACKEND_MARKERS = ("gloo", "nccl", "NCCL", "Timed out", "Connection closed", "Connection reset")


def is_collective_failure(err: BaseException) -> bool:
    """True when ``err`` is a failed or timed-out collective (not a bug in the step's own code)."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _BACKEND_MARKERS)


@contextmanager
def collective_step(step: int) -> Iterator[None]:
    """Re-raise a failed or timed-out collective inside the block as `CollectiveError` naming
    this rank and ``step`` (the original error is chained)."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CollectiveError) or not is_collective_failure(err):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise CollectiveError(
            f"rank {rank} of {world} failed at step {step}: a collective did not complete "
            f"(a peer rank died, hung or diverged): {err}"
        ) from err
