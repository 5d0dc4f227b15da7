"""Errors that mean "the input was wrong", and how the command line reports them.

Library functions raise `UserError` (a ``ValueError``, so callers that catch ``ValueError`` keep
working) with a message naming the file, line or field, what was wrong and what is allowed; an
``OSError`` naming the path the user gave counts too (`is_user_error`). The ``densetrain``
command line (``cli/main.py``) turns such an error into one line on stderr and exit 2
(``--debug`` shows the traceback); any other exception is a bug: its traceback is printed.
`RankFailure` (a peer rank died or stopped) is printed the same way, with an exit status of its
own.
"""

from __future__ import annotations

import errno


class UserError(ValueError):
    """Bad input: the message names the file, line or field, what was wrong and what is allowed."""


class UnsafeFileError(UserError):
    """A file holds something densetrain refuses to load (e.g. a pickle naming a code object)."""


class DamagedFileError(UserError):
    """A file densetrain wrote is truncated, corrupted or does not match its recorded checksum."""


class RankFailure(RuntimeError):
    """Another rank of the job died or stopped: an operational failure, not a bug nor bad input.
    The message names the lost rank(s) when their heartbeats tell (``parallel/heartbeat.py``);
    the command line prints it as one line and exits with its own status, so that a scheduler
    can tell "restart, perhaps without that host" from a crash."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (still a ``FileNotFoundError``)."""


class UserFileExistsError(UserError, FileExistsError):
    """An output the user named is in the way (still a ``FileExistsError``)."""


class UserNotADirectoryError(UserError, NotADirectoryError):
    """A path the user gave as a directory is a file (still a ``NotADirectoryError``)."""


class MissingDependencyError(UserError, ImportError):
    """An optional dependency is not installed; the message names what to ``pip install``."""


# Disk full / quota / read-only disk: the machine's state, reported as one line (`describe_error`).
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def is_user_error(error: BaseException) -> bool:
    """Whether ``error``'s message is written for the user (printed as one line, no traceback):
    a `UserError`, or an ``OSError`` that names a path (a file the user gave that is missing,
    unreadable, a directory, ...) or a full / read-only disk. Anything else — a bare
    ``ValueError``, ``TypeError``, ``KeyError``, an ``OSError`` naming no path — is a bug."""
    if isinstance(error, UserError):
        return True
    if isinstance(error, OSError):
        return bool(error.filename) or error.errno in _ENVIRONMENT_ERRNOS
    return False


def unwrap_error(error: BaseException) -> BaseException:
    """The first rank's original exception inside a DCP ``CheckpointException`` (which derives
    from ``BaseException`` and prints tracebacks in its message), else ``error`` itself."""
    failures = getattr(error, "failures", None)
    if type(error).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return error


def describe_error(error: BaseException) -> str:
    """The one-line message printed for ``error`` (disk-full and read-only disks named as such)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" while writing {error.filename}" if error.filename else ""
        return f"no space left on device{where}; free some space or write elsewhere"
    if isinstance(error, OSError) and error.errno == errno.EROFS:
        where = f" {error.filename}" if error.filename else ""
        return f"read-only file system:{where} cannot be written; choose a writable location"
    if isinstance(error, OSError) and error.filename and str(error.filename) not in str(error):
        return f"{error.filename}: {error.strerror or error}"
    text = str(error).strip()
    if isinstance(error, KeyError):
        text = f"missing key {text}"
    return text or type(error).__name__
