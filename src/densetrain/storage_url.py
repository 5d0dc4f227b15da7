"""Checkpoint URLs (``scheme://...``) as config validation reads them, without importing torch
(`densetrain train` validates the job before it restarts itself with a tuned allocator, and
whatever it imports then would be imported twice). The storage itself: `checkpoint.objstore`.
"""

from __future__ import annotations

import re
import threading
from typing import Any

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
EXTRA_HINT = "pip install 'densetrain[s3]'"


def url_scheme(value: Any) -> str | None:
    """The scheme of ``value`` when it is a ``scheme://...`` string, else None."""
    match = _URL_RE.match(value) if isinstance(value, str) else None
    return match.group(1).lower() if match else None


def is_remote(value: Any) -> bool:
    """True for a URL handled through fsspec (any scheme but ``file``)."""
    scheme = url_scheme(value)
    return scheme is not None and scheme != "file"


def url_problem(field: str, value: str) -> str | None:
    """Why ``value`` cannot be a checkpoint URL (one line naming ``field``), or None. Imports
    the scheme's filesystem package; touches no server."""
    scheme = url_scheme(value)
    if scheme is None:
        return None
    rest = _URL_RE.match(value).group(2)
    if scheme == "file":
        if not rest.startswith("/"):
            return f"{field}={value!r}: a file:// URL needs an absolute path (file:///abs/dir)"
        return None
    if not rest.split("/", 1)[0]:
        return f"{field}={value!r} names no bucket (expected {scheme}://BUCKET/PREFIX)"
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except ImportError as err:
        return (f"{field}={value!r} needs the {scheme}:// filesystem package, which is not "
                f"installed ({err.name or err}): {EXTRA_HINT}")
    except ValueError:
        return f"{field}={value!r}: fsspec knows no filesystem for the scheme {scheme}://"
    return None


_retries = 0
_retries_lock = threading.Lock()


def bucket_problem(fs: Any, path: str, url: str, field: str) -> str | None:
    """Why the bucket of ``url`` (``path`` on the fsspec filesystem ``fs``) cannot be used, one
    line naming ``field``, or None: one request, nothing written."""
    bucket = path.split("/", 1)[0]
    try:
        found = fs.exists(bucket)
    except Exception as err:  # noqa: BLE001 - botocore/aiohttp raise many types for a refusal
        return (f"{field} {url} cannot be reached ({type(err).__name__}: {err}); check the "
                "endpoint (AWS_ENDPOINT_URL) and credentials")
    if not found:
        return (f"{field} {url}: the bucket {bucket!r} does not exist (or these credentials "
                "cannot see it); create it first")
    return None


def count_retry() -> None:
    """Record one retried request to an object store (called from the storage library's own
    threads: `checkpoint.objstore` hooks botocore's attempts)."""
    global _retries
    with _retries_lock:
        _retries += 1


def take_retries() -> int:
    """The retried object-store requests since the previous call (the goodput ledger records
    them per line)."""
    global _retries
    with _retries_lock:
        taken, _retries = _retries, 0
    return taken
