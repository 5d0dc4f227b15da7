"""Run a function on N real ``torch.distributed`` ranks (gloo on CPU) from inside pytest.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each (rendezvous over TCP on a free loopback port), calls
``fn(rank, world_size, *args)`` and returns the list of per-rank return values (which must be
picklable). A failing rank re-raises in the parent with that rank's traceback; a rank that hangs is
killed after ``timeout`` seconds and named in the error.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple,
    threads: int,
    pg_timeout_s: float,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    # A rank still running shortly before the parent gives up prints every thread's Python
    # stack to stderr, so a hang in CI shows where each rank waits.
    faulthandler.dump_traceback_later(max(pg_timeout_s - 10.0, 1.0), exit=False)
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        payload = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tmp = result_path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, result_path)
    # The rank's result is on disk: leave without the interpreter's teardown. After a context
    # parallel step on gloo, torch 2.13's C++ teardown at exit sometimes aborts the process
    # ("terminate called without an active exception", about 1 run in 8, no Python frame on
    # the stack), which would read as a rank that died although its step had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DistributedTestError(RuntimeError):
    """A spawned rank failed or hung."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results.

    ``fn`` must be importable by name (a module-level function) because ranks are spawned.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="densetrain-dist-") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), out_dir, fn, args, threads_per_rank, timeout),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            # join() returns after any one rank exits; keep joining the rest until all have
            # exited or ``timeout`` (counted from the spawn) has passed.
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    break
        except mp.ProcessRaisedException as e:  # pragma: no cover - worker catches everything
            raise DistributedTestError(str(e)) from None
        except mp.ProcessExitedException as e:
            raise DistributedTestError(f"a rank died: {e}") from None
        results: list[Any] = []
        missing = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                missing.append(rank)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{value}")
            results.append(value)
        if missing:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise DistributedTestError(
                f"ranks {missing} of {world_size} produced no result within {timeout:.0f} s "
                "(hung or killed)"
            )
        return results
