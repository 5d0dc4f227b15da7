"""Process-group setup from the torchrun environment, and errors that name the rank and step.

torchrun (single node: ``--standalone``; multi-node: ``--rdzv-backend=c10d``) sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address; `init_distributed` reads them and
starts NCCL on CUDA or gloo on CPU with a collective timeout, so a rank that dies or hangs makes
the others fail after ``timeout_s`` instead of waiting forever. Each rank of a multi-process job
also runs a heartbeat (`densetrain.parallel.heartbeat`), so that a failed collective names the
rank that died or stopped, not only the rank that noticed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from densetrain.errors import RankFailure, UserError
from densetrain.parallel import heartbeat

logger = logging.getLogger(__name__)

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


class CollectiveError(RankFailure):
    """A collective failed or timed out; the message names this rank and the training step, and
    the lost peer(s) as their heartbeats tell. The backend's own text is in ``backend_error``
    (and the chained exception), not in the message: it names neither rank nor step."""

    def __init__(self, message: str, backend_error: str = "") -> None:
        super().__init__(message)
        self.backend_error = backend_error


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name} must be an integer, got {raw!r}") from None


def env_world_size() -> int:
    """The world size torchrun announces (``WORLD_SIZE``; 1 without torchrun), read without
    starting a process group, so that a layout is checked before any rank waits on another.
    A process group already initialised (by a test helper) gives its own size."""
    if dist.is_initialized():
        return dist.get_world_size()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise UserError(f"environment variable WORLD_SIZE must be >= 1, got {world_size}")
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
        raise UserError(f"environment variable LOCAL_WORLD_SIZE must be an integer >= 1 (the "
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
        raise UserError(f"timeout_s must be > 0, got {timeout_s}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise UserError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        heartbeat.start_heartbeat()
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
        heartbeat.start_heartbeat()
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def destroy_distributed() -> None:
    """Tear down the default process group (and this rank's heartbeat) if one is running."""
    heartbeat.stop_heartbeat()
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


def collective_error(err: BaseException, step: int | None = None) -> CollectiveError:
    """`CollectiveError` for the failed collective ``err``: this rank, ``step`` (default: the
    step of this rank's heartbeat) and the lost peer(s) as the heartbeats tell. Reading them
    takes `heartbeat.OBSERVE_S` seconds, long enough for a dead rank's heartbeat to fall
    silent while the living keep beating. The backend's text goes to the log (debug level)."""
    beat = heartbeat.current_heartbeat()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif beat is not None:
        rank, world = beat.rank, beat.world_size
    else:
        rank, world = 0, 1
    if step is None:
        step = beat.step if beat is not None else 0
    raw = str(err).strip()
    logger.debug("rank %d: collective failed at step %d: %s", rank, step, raw)
    who = beat.explain() if beat is not None else "a peer rank died, hung or diverged"
    return CollectiveError(
        f"rank {rank} of {world} failed at step {step}: a collective did not complete: {who}",
        backend_error=raw,
    )


@contextmanager
def collective_step(step: int) -> Iterator[None]:
    """Re-raise a failed or timed-out collective inside the block as `CollectiveError` naming
    this rank, ``step`` and the lost peer (the original error is chained). The step is this
    rank's heartbeat's step from here on."""
    heartbeat.note_step(step)
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CollectiveError) or not is_collective_failure(err):
            raise
        raise collective_error(err, step) from err
