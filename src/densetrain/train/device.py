"""Device choice and mixed-precision context for the trainer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch

from densetrain.errors import UserError
from densetrain.parallel.distributed import env_local_world_size


def resolve_device(name: str, *, local_rank: int = 0, field: str = "training.device"
                   ) -> torch.device:
    """``auto`` → this rank's GPU when CUDA is available, else CPU; other names as given
    (``cpu``, ``cuda``, ``cuda:N``, ``mps``, ...).

    Raises ``ValueError`` naming ``field`` (the config field or flag the name came from) when
    the name is not a device or the device is not there.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    given = f"{field} {name}" if field.startswith("--") else f"{field}={name!r}"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"{given} is not a device; allowed: auto, cpu, cuda, "
                        "cuda:N, mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = ("this PyTorch build has no CUDA" if torch.version.cuda is None
                     else "no CUDA device is visible")
            raise UserError(f"{given} but {build} (torch {torch.__version__}); "
                            "use 'cpu' or 'auto'")
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", local_rank % count)
        elif device.index >= count:
            raise UserError(f"{given} but only {count} CUDA device(s) are visible "
                            f"(cuda:0 to cuda:{count - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{given} but MPS is not available; use 'cpu'")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"{given}: densetrain runs on cpu, cuda and mps devices")
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
        raise UserError(f"training.dtype must be 'fp32' or 'bf16', got {dtype!r}")

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


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: taskset, cgroup cpusets,
    Slurm's binding), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this OS
        return os.cpu_count() or 1


def tune_cpu_threads(device_type: str, environ: Mapping[str, str] | None = None, *,
                     cores: int | None = None) -> str | None:
    """Fit torch's intra-op threads of a CPU rank to its share of the host's cores; return the
    start line saying what was done (None on an accelerator).

    ``LOCAL_WORLD_SIZE`` ranks (`env_local_world_size`) share ``cores``
    (`available_cores`), ``cores // ranks`` each. Without ``OMP_NUM_THREADS`` torch gives every
    process a thread per core, so N ranks started by a launcher other than torchrun would ask
    for N times as many threads as there are cores: such a rank is cut to its share. (On a
    2-core host, 2 ranks x 2 threads trained as fast as 2 x 1, within the noise; the cut is
    what torchrun's own default of one thread per rank guards against on larger hosts.) A set
    ``OMP_NUM_THREADS`` (the user's, or torchrun's) is kept; the line says when it asks for
    more than the share, or leaves half the cores or more idle.
    """
    if device_type != "cpu":
        return None
    environ = os.environ if environ is None else environ
    cores = cores if cores is not None else available_cores()
    local = env_local_world_size(environ)
    threads = torch.get_num_threads()
    share = max(1, cores // local)
    many = local > 1
    unit = "rank" if many else "process"
    where = f"{cores} cores for {local} ranks on this host" if many else f"{cores} cores"
    if local > cores:
        where += ": more ranks than cores"
    setting = environ.get("OMP_NUM_THREADS")
    if threads > share:
        if setting is None:
            torch.set_num_threads(share)
            return (f"cpu threads: {share} per {unit} ({where}; OMP_NUM_THREADS sets another "
                    "count)")
        asked = f"{local} ranks x {threads} threads" if many else f"{threads} threads"
        return (f"note: OMP_NUM_THREADS={setting} runs {asked} on {cores} cores, more "
                f"threads than cores; OMP_NUM_THREADS={share} fits this host")
    if setting is not None and 2 * threads * local <= cores:
        torchrun, ranks = (" (torchrun sets 1 when it is unset)",
                           f" ({local} ranks x {threads})") if many else ("", "")
        return (f"note: OMP_NUM_THREADS={setting}{torchrun} keeps {threads * local} of the "
                f"{cores} cores busy{ranks}; OMP_NUM_THREADS={share} uses them all")
    told = f"; OMP_NUM_THREADS={setting}" if setting and setting.strip() == str(threads) else ""
    return f"cpu threads: {threads} per {unit} ({where}{told})"
