"""One run per directory: ``<run_dir>/densetrain.lock`` held for the run's life.

Rank 0 holds an exclusive ``flock`` on the lock file (the kernel drops it when the process dies,
however it dies, so a dead holder can never block a restart) and writes its host, pid and start
time into it for the messages. A second run in the same directory fails at once naming the
holder; a lock file left by a process that no longer holds it (killed, crashed, machine
rebooted) is taken over with a message. ``flock`` is used rather than pid liveness alone
because a pid can be reused by an unrelated process.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from densetrain.checkpoint import collective
from densetrain.checkpoint.manager import CheckpointError
from densetrain.errors import UserError

LOCK_FILE = "densetrain.lock"


class RunLockedError(CheckpointError):
    """Another live run holds the run directory's lock."""


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown process (the lock file is empty)"
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r}, started "
            f"{holder.get('start_time')}")


def _read_holder(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"pid": "?", "host": "?", "start_time": f"(unreadable lock file: {raw[:60]!r})"}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """The lock of one run directory; a context manager (acquire on enter, release on exit)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this process holds the lock."""
        return self._fd is not None

    def _open_locked(self) -> int:
        """An fd of the lock file under our flock; retried when the holder removed the file
        between our open and our flock (we would otherwise hold a lock on a deleted file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockedError(
                    f"run directory {self.path.parent} is in use by another densetrain run: "
                    f"{_describe(holder)} (lock file {self.path}). Wait for it to finish, stop "
                    "it, or give this run another logging.run_dir"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def acquire(self) -> None:
        """Take the lock or raise `RunLockedError` naming the live holder."""
        fd = self._open_locked()
        previous = _read_holder(fd)
        if previous:
            print(f"taking over the lock of {self.path.parent} left by {_describe(previous)}, "
                  "which no longer runs", file=sys.stderr)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(info) + "\n").encode("utf-8"))
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (no-op when not held)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it: no one sees it unlocked
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_run_lock(run_dir: str | os.PathLike) -> RunLock:
    """Rank 0 takes the lock of ``run_dir``; every rank raises `RunLockedError` when it is held
    by another run (collective), and ``UserError`` when the lock file cannot be made (a
    directory or other non-file in its place, an unwritable run directory). Returns the lock
    (held on rank 0 only); call ``release()``."""
    lock = RunLock(run_dir)
    failure = None
    if collective.rank() == 0:
        try:
            if lock.path.exists() and not lock.path.is_file():
                kind = "a directory" if lock.path.is_dir() else "not a regular file"
                raise UserError(
                    f"{lock.path} is {kind}, but densetrain keeps its lock file there (one run "
                    "per run directory); remove it, or give this run another logging.run_dir")
            lock.acquire()
        except RunLockedError as err:
            failure = ("locked", str(err))
        except UserError as err:
            failure = ("unusable", str(err))
        except OSError as err:
            failure = ("unusable", f"cannot create the lock file {lock.path}: "
                                   f"{err.strerror or err}")
    failures = [f for f in collective.gather_all(failure) if f]
    if failures:
        lock.release()
        kind, message = failures[0]
        raise RunLockedError(message) if kind == "locked" else UserError(message)
    return lock
