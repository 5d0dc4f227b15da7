"""The few collectives checkpoint code needs, written so that one process needs no group.

Every helper takes an optional process group (None = the default group) and is a no-op or a
list of one on a single process, so the same checkpoint code runs with and without
``torch.distributed``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

SINGLE_PROCESS_NOTICE = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
                         r"assuming the intent is to (save|load) in a single process")
"""The UserWarning DCP gives for every save and load without a process group."""


def quiet_single_process_notice() -> None:
    """Ignore `SINGLE_PROCESS_NOTICE` process-wide: densetrain's single-process saves and loads
    mean it. A filter for the whole process, not a ``warnings.catch_warnings`` block, because
    ``dcp.async_save`` issues the notice from its writer thread after the caller's block has
    closed (and ``catch_warnings`` is not thread-safe). Repeated calls add no second filter."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE, category=UserWarning)


def dist_on() -> bool:
    """True when a default process group is running."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 on one process)."""
    return dist.get_rank() if dist_on() else 0


def world_size() -> int:
    """Number of ranks (1 on one process)."""
    return dist.get_world_size() if dist_on() else 1


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group``."""
    if dist_on():
        dist.barrier(group=group)


def gather_all(value: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``value`` on every rank, in rank order."""
    if not dist_on():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def first_error(value: str | None, group: Any = None) -> str | None:
    """The first non-empty error text over all ranks (every rank gets the same answer)."""
    errors = [v for v in gather_all(value, group) if v]
    return errors[0] if errors else None


def new_cpu_group(timeout_s: float) -> Any:
    """A gloo group over all ranks for checkpoint and signal traffic (None on one process).

    Background checkpoint writes and the per-step stop vote must not share the training group:
    collectives issued from two threads on one group may interleave.
    """
    if not dist_on():
        return None
    from datetime import timedelta

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
