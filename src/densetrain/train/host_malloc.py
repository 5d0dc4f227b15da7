"""The host allocator settings the trainer applies itself (glibc ``mallopt``).

glibc's malloc serves every allocation above its mmap threshold (128 KiB at first, adapting up
to 32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` on free. A training step on CPU
allocates and frees the same large activations and gradients every step, so each step
page-faults them in again; on 2 CPU cores about half the step showed as system time, and keeping
them in the heap measured +14-25% tokens/s (benchmarks/RESULTS.md, "allocator"). The same
settings could be given as ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:...`` in the environment, but
that is read only at process start, so only a wrapper such as ``make train`` could set it; a user
running ``densetrain train`` directly or under ``torchrun`` would not get it. ``mallopt`` sets the
same two parameters from inside the running process, before the run allocates its tensors.

Set at run time, though, they do not always hold: where the heap cannot grow in place (the
address space above it already mapped), glibc serves a large block by ``mmap`` anyway and the
page faults come back (seen in 1 of 6 fresh processes on the test machine). So the
``densetrain train`` command, before it imports torch, starts itself again with
``GLIBC_TUNABLES`` set (`restart_with_tuned_allocator`); ``mallopt`` is the fallback for a run
started from Python (``densetrain.train.train``), where the process is not the command's own.

There is no library for this (it is two libc calls through ``ctypes``). The cost is memory that
is not returned to the system between steps (about the size of one step's largest tensors).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from densetrain.config.sections import HOST_ALLOCATORS
from densetrain.errors import UserError

__all__ = ["HOST_ALLOCATORS", "TUNED_GLIBC_TUNABLES", "restart_with_tuned_allocator",
           "tune_host_allocator"]

TUNED_GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"
_SET_BY_DENSETRAIN = "DENSETRAIN_TUNED_MALLOC"

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD_BYTES = 4 * 2**30


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc (not musl)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def restart_with_tuned_allocator(choice: str, device: str, argv: list[str]) -> None:
    """Replace this process by ``python -m densetrain *argv`` with the tuned ``GLIBC_TUNABLES``
    (same pid, so torchrun and schedulers see no change), when ``choice`` is ``tuned``, the run
    may be on the CPU (``device`` ``cpu`` or ``auto``), the C library is glibc and the
    environment does not set the malloc tunables already. Returns when nothing is to be done."""
    if choice != "tuned" or device not in ("cpu", "auto") or os.environ.get(_SET_BY_DENSETRAIN):
        return
    existing = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.mmap_max" in existing or _glibc() is None:
        return
    env = dict(os.environ, **{_SET_BY_DENSETRAIN: "1"})
    env["GLIBC_TUNABLES"] = ":".join(t for t in (existing, TUNED_GLIBC_TUNABLES) if t)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "densetrain", *argv], env)


def tune_host_allocator(choice: str, device_type: str) -> str:
    """Apply ``choice`` to this process's malloc and return a line saying what was done.

    ``tuned`` applies only to CPU runs (on an accelerator the large tensors are not in host
    memory) and only where the allocator is glibc's. A ``GLIBC_TUNABLES`` that already sets
    ``glibc.malloc.mmap_max`` is the user's choice and is left as it is.
    """
    if choice not in HOST_ALLOCATORS:
        raise UserError(f"training.host_allocator must be one of {HOST_ALLOCATORS}, "
                        f"got {choice!r}")
    if choice == "system":
        return "host allocator: system defaults (training.host_allocator=system)"
    if device_type != "cpu":
        return f"host allocator: system defaults (tensors live on {device_type})"
    if "glibc.malloc.mmap_max" in os.environ.get("GLIBC_TUNABLES", ""):
        if os.environ.get(_SET_BY_DENSETRAIN):
            return ("host allocator: large blocks kept in the heap (GLIBC_TUNABLES set by "
                    "densetrain train at start)")
        return "host allocator: as set by GLIBC_TUNABLES"
    libc = _glibc()
    if libc is None:
        return "host allocator: system defaults (not glibc)"
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        return "host allocator: system defaults (mallopt refused the settings)"
    return "host allocator: large blocks kept in the heap where it can grow (glibc mallopt)"
