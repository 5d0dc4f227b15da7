"""`check_writable_dir`: a run's output directory must be a directory that can be written.

Run before any work, so that a ``run_dir`` that is a file, or that lies on a read-only or full
disk, is named at once rather than after the model is built (or at the first checkpoint).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from densetrain.errors import UserError


def check_writable_dir(path: str | os.PathLike, *, field_name: str) -> Path:
    """Create ``path`` (with parents) if needed and write a probe file in it; return it.

    Raises ``UserError`` naming ``field_name`` when ``path`` or a parent is a file, or when the
    directory cannot be created or written (read-only disk, permissions, no space left).
    """
    directory = Path(path)
    for parent in (directory, *directory.parents):
        if parent.exists() and not parent.is_dir():
            raise UserError(
                f"{field_name}={str(path)!r}: {parent} exists and is not a directory; choose a "
                "directory path"
            )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as probe:
            probe.write(b"probe")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        reason = error.strerror or str(error)
        raise UserError(
            f"{field_name}={str(path)!r} cannot be written: {reason}; choose a writable location"
        ) from error
    return directory
