"""Device choice and mixed-precision context for the trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """``auto`` → this rank's GPU when CUDA is available, else CPU; other names as given.

    Raises ``ValueError`` naming ``training.device`` when the requested device is unavailable.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"training.device={name!r} but no CUDA device is visible; use 'cpu' or 'auto'"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"training.device={name!r} but MPS is not available; use 'cpu'")
    return device


def autocast_factory(
    device: torch.device, dtype: str
) -> Callable[[], AbstractContextManager[None]]:
    """A factory of the forward-pass precision context: bf16 autocast, or nothing for fp32.

    Parameters, gradients and optimizer state stay fp32 (master weights); only the matmuls and
    other autocast-listed ops run in bf16.
    """
    if dtype == "fp32":
        return contextlib.nullcontext
    if dtype != "bf16":
        raise ValueError(f"training.dtype must be 'fp32' or 'bf16', got {dtype!r}")

    def bf16_autocast() -> AbstractContextManager[None]:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    return bf16_autocast


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated accelerator memory since start, or None on CPU (see `peak_rss_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes.

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this process image.
    (``getrusage`` ``ru_maxrss`` is not used there: it carries over the parent's peak into a
    child started by vfork + exec, as Python's subprocess does.) Elsewhere ``getrusage``.
    """
    import resource
    import sys

    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
