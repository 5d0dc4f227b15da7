"""Checkpoints under an fsspec URL (``s3://bucket/prefix``): no rename, so the manifest is last.

``checkpoint.dir`` may be a URL. ``file://PATH`` is the local directory PATH (the local code,
with its ``.tmp`` rename). Any other scheme goes through fsspec: the DCP shards are written by
DCP's own fsspec storage (``FsspecWriter`` / ``FsspecReader``) straight under the final prefix
``<dir>/step-N/``, then ``config.toml``, then ``manifest.json`` (size and SHA-256 of every file,
hashed by each rank as its bytes are sent, `HashingWriter`; before the manifest, the store's
listing must show every object at the size sent). An object store has no atomic rename, so a prefix
is a checkpoint only when its manifest exists and verifies; one without a manifest, or whose
files do not match it, is partial: resume names it and skips it, listing and pruning leave it.
A save of step N over a partial ``step-N`` prefix removes the manifest first, then the rest.

Credentials and the endpoint come from the storage library's own settings: for S3 the standard
AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_DEFAULT_REGION``) or ``~/.aws/config`` profiles, as every boto-based tool reads them.
With ``checkpoint.async_save`` the shards are written in the background by
``dcp.async_save`` through the same writer, and config and manifest follow once it has
finished (async_save.py): the same order, so a background save is visible only when complete.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp

from densetrain.checkpoint import collective
from densetrain.checkpoint.manifest import (
    MANIFEST_FILE,
    Damage,
    FileDigest,
    manifest_text,
    parse_manifest,
    sha256_text,
)
from densetrain.errors import UserError

# torch-free (config validation imports them before torch): re-exported for the callers here
from densetrain.storage_url import (  # noqa: F401
    _URL_RE,
    EXTRA_HINT,
    bucket_problem,
    count_retry,
    is_remote,
    url_problem,
    url_scheme,
)

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_CHUNK = 8 << 20
CONFIG_FILE = "config.toml"


class ObjectStoreError(UserError):
    """A checkpoint URL cannot be used (missing package, missing bucket, refused access)."""


def checkpoint_location(value: str) -> Any:
    """``checkpoint.dir`` as the code takes it: a local ``Path`` (``file://`` stripped) or the
    URL string without a trailing slash."""
    from pathlib import Path

    if url_scheme(value) == "file":
        return Path(_URL_RE.match(value).group(2))
    if is_remote(value):
        return value.rstrip("/")
    return Path(value)


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it (its S3 client counting its
    retries, `_count_retries`)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as err:
        raise ObjectStoreError(f"checkpoint.dir {url} needs a package that is not installed "
                               f"({err.name or err}): {EXTRA_HINT}") from None
    _count_retries(fs)
    return fs, path


def _on_request(request: Any = None, **_: Any) -> None:
    if ((getattr(request, "context", None) or {}).get("retries") or {}).get("attempt", 1) > 1:
        count_retry()


# What s3fs's own retry loop (s3fs.core._error_wrapper) re-issues a failed call for: a ClientError
# whose text holds one of these (its list, inline there), or an exception of
# s3fs.core.S3_RETRYABLE_ERRORS (module-level, extended by s3fs.add_retryable_error).
_S3FS_RETRIED_TEXT = ("SlowDown", "reduce your request rate", "XAmzContentSHA256Mismatch")


def _on_call_done(http_response: Any = None, parsed: Any = None, **_: Any) -> None:
    """botocore's ``after-call``: the call's final answer, after botocore's own attempts. An
    error answer s3fs retries (throttling) means one more request s3fs sends as a new call."""
    if getattr(http_response, "status_code", 200) < 300:
        return
    error = (parsed or {}).get("Error") or {}
    text = f"{error.get('Code', '')} {error.get('Message', '')}"
    if any(pattern in text for pattern in _S3FS_RETRIED_TEXT):
        count_retry()


def _on_call_error(exception: BaseException | None = None, **_: Any) -> None:
    """botocore's ``after-call-error``: the call raised after botocore's own attempts (a
    timeout, a dropped connection, an unparsable answer); s3fs re-issues those it lists."""
    from s3fs.core import S3_RETRYABLE_ERRORS

    if exception is not None and isinstance(exception, S3_RETRYABLE_ERRORS):
        count_retry()


def _count_retries(fs: Any) -> None:
    """Count every retried request of ``fs``'s S3 client into `storage_url.take_retries` (the
    goodput ledger's ``storage_retries``). Two layers retry, and neither reports it:

    * botocore retries timeouts, dropped connections, 5xx and throttling (SlowDown) with
      exponential backoff, up to its ``max_attempts``: its ``request-created`` event is sent for
      every attempt with the attempt number in its context; an attempt past the first is a
      retry.
    * s3fs retries the whole call again on top (``_error_wrapper``, up to ``fs.retries`` times)
      when botocore gave up on throttling or on a connection error: that call starts again at
      attempt 1, so ``request-created`` does not see it. s3fs has no hook of its own for this
      (``set_custom_error_handler`` is global, replaces the user's, and is not consulted for
      SlowDown or connection errors), so botocore's public ``after-call`` (an error answer) and
      ``after-call-error`` (an exception) events count each call s3fs will re-issue, with
      s3fs's own criteria. A call that fails on s3fs's last try counts one retry too many; the
      operation then fails anyway.

    fsspec's DCP writer and reader get the same cached filesystem, hence this client."""
    if type(fs).__name__ != "S3FileSystem" or getattr(fs, "asynchronous", False):
        return
    client = fs.s3  # connects (sync), as the first request would
    if not getattr(client, "_densetrain_counts_retries", False):
        client.meta.events.register("request-created.s3", _on_request)
        client.meta.events.register("after-call.s3", _on_call_done)
        client.meta.events.register("after-call-error.s3", _on_call_error)
        client._densetrain_counts_retries = True


def check_reachable(url: str) -> None:
    """Raise `ObjectStoreError` naming ``url`` when its bucket does not exist or cannot be
    reached (wrong endpoint, no credentials); nothing is written."""
    fs, path = filesystem(url)
    problem = bucket_problem(fs, path, url, "checkpoint.dir")
    if problem is not None:
        raise ObjectStoreError(problem)


def join(url: str, name: str) -> str:
    """``url/name``."""
    return f"{url.rstrip('/')}/{name}"


def basename(url: str) -> str:
    """The last part of ``url`` (``step-N``)."""
    return posixpath.basename(url.rstrip("/"))


def _listing(url: str) -> list[dict[str, Any]]:
    fs, path = filesystem(url)
    fs.invalidate_cache()  # another process (or this one, just before) may have written
    try:
        return fs.ls(path, detail=True)
    except FileNotFoundError:
        return []


def checkpoint_dirs(url: str) -> list[tuple[int, str]]:
    """Every ``step-N`` prefix under ``url`` as ``(step, url)``, oldest first, with a manifest
    or not."""
    found = []
    for entry in _listing(url):
        name = posixpath.basename(entry["name"].rstrip("/"))
        match = _STEP_RE.match(name)
        if match and entry.get("type") == "directory":
            found.append((int(match.group(1)), join(url, name)))
    return sorted(found)


def _files(checkpoint: str) -> dict[str, int]:
    """Name -> size of the objects directly under ``checkpoint``."""
    return {posixpath.basename(e["name"]): int(e.get("size") or 0)
            for e in _listing(checkpoint) if e.get("type") == "file"}


def has_manifest(checkpoint: str) -> bool:
    """True when ``checkpoint`` holds a manifest object (see `verify` for whether it holds)."""
    return MANIFEST_FILE in _files(checkpoint)


def list_checkpoints(url: str) -> list[tuple[int, str]]:
    """The ``step-N`` prefixes under ``url`` that hold a manifest, oldest first."""
    return [(s, c) for s, c in checkpoint_dirs(url) if has_manifest(c)]


def read_text(checkpoint: str, name: str) -> str | None:
    """The UTF-8 text of ``checkpoint/name``, or None when there is no such object."""
    fs, path = filesystem(join(checkpoint, name))
    try:
        return fs.cat_file(path).decode("utf-8")
    except FileNotFoundError:
        return None


def _digest(checkpoint: str, name: str) -> FileDigest:
    fs, path = filesystem(join(checkpoint, name))
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(name=name, size=size, sha256=digest.hexdigest())


def _read_manifest(checkpoint: str) -> tuple[dict[str, Any] | None, Damage | None]:
    try:
        text = read_text(checkpoint, MANIFEST_FILE)
    except UnicodeDecodeError as err:
        return None, Damage(file=MANIFEST_FILE, problem=f"unreadable ({err})")
    if text is None:
        return None, Damage(file=MANIFEST_FILE, problem="missing (a save that did not finish, "
                            "or objects deleted since)")
    return parse_manifest(text)


def verify(checkpoint: str) -> list[Damage]:
    """What is wrong with ``checkpoint`` against its manifest: missing, extra or resized
    objects, then every object's SHA-256 (read back). Empty when it verifies."""
    manifest, unreadable = _read_manifest(checkpoint)
    if unreadable is not None:
        return [unreadable]
    return _size_damage(checkpoint, manifest) or _hash_damage(checkpoint, manifest)


def _size_damage(checkpoint: str, manifest: dict[str, Any]) -> list[Damage]:
    present = _files(checkpoint)
    listed = manifest["files"]
    damage = []
    for name, entry in sorted(listed.items()):
        if name not in present:
            damage.append(Damage(file=name, problem="missing"))
        elif present[name] != entry["bytes"]:
            damage.append(Damage(file=name, problem=f"{present[name]} bytes, the manifest says "
                                 f"{entry['bytes']} (truncated or overwritten)"))
    damage += [Damage(file=n, problem="not listed in the manifest")
               for n in sorted(present) if n not in listed and n != MANIFEST_FILE]
    return damage


def _hash_damage(checkpoint: str, manifest: dict[str, Any]) -> list[Damage]:
    damage = []
    for name, entry in sorted(manifest["files"].items()):
        try:
            digest = _digest(checkpoint, name)
        except OSError as err:
            damage.append(Damage(file=name, problem=f"unreadable ({err})"))
            continue
        if digest.sha256 != entry["sha256"]:
            damage.append(Damage(file=name, problem=f"SHA-256 {digest.sha256[:16]}... differs "
                                 f"from the manifest's {entry['sha256'][:16]}..."))
    return damage


def remove(checkpoint: str) -> None:
    """Delete ``checkpoint``: its manifest first, so that a half-deleted prefix is never taken
    as complete."""
    fs, path = filesystem(checkpoint)
    fs.invalidate_cache()
    try:
        fs.rm_file(f"{path}/{MANIFEST_FILE}")
    except FileNotFoundError:
        pass
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def prune(url: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints with a manifest; return them."""
    doomed = [c for _, c in list_checkpoints(url)[:-keep_last]]
    for checkpoint in doomed:
        remove(checkpoint)
    return doomed


def _describe(err: BaseException, url: str, step: int) -> str:
    from densetrain.checkpoint.saving import _errors_in

    inner = next((e for e in reversed(_errors_in(err)) if not e.__class__.__name__.startswith(
        "CheckpointException")), err)
    return (f"saving checkpoint step {step} to {url} failed ({type(inner).__name__}: {inner}); "
            "the step-N prefix holds no manifest, so it is never taken as a checkpoint, and "
            "earlier checkpoints are untouched")


def begin(url: str, step: int, group: Any = None) -> tuple[str, bool]:
    """Ready ``url/step-N`` for a save (collective over ``group``): ``(checkpoint URL, skip)``.
    ``skip`` is True when a ``step-N`` whose manifest exists and whose objects have the listed
    sizes is there already (the same step saved twice); otherwise rank 0 removes whatever
    partial prefix is there (manifest first)."""
    from densetrain.checkpoint.manager import CheckpointError

    final = join(url, f"step-{step:08d}")
    failure = None
    skip = False
    if collective.rank() == 0:
        try:
            manifest, unreadable = _read_manifest(final)
            skip = unreadable is None and not _size_damage(final, manifest)
            if not skip:
                remove(final)
        except Exception as err:
            failure = _describe(err, final, step)
    failure = collective.first_error(failure, group)
    if failure:
        raise CheckpointError(failure)
    return final, bool(collective.gather_all(skip, group)[0])


class _HashedStream:
    """A write stream that hashes what passes through it (every other call goes to the
    stream it wraps)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def writer(final: str) -> Any:
    """DCP's fsspec storage writer for the prefix ``final`` (shards and ``.metadata``) that
    records the size and SHA-256 of every object this rank writes (`HashingWriter.written`).

    Hashing the bytes as they are sent, rather than reading the objects back, keeps a save to
    one transfer (a read-back was a second one, all of it on rank 0: at scale, the whole
    checkpoint downloaded by one process), and the manifest then records what the job meant
    to store, which every later verification compares the store against. Written here because
    DCP's writer keeps no digests; it wraps DCP's fsspec storage, not a copy of it.
    """
    import threading
    from contextlib import contextmanager

    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.digests: dict[str, FileDigest] = {}
            self._lock = threading.Lock()  # DCP may write files on several threads

        @contextmanager
        def create_stream(self, path: Any, mode: str):
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashed = _HashedStream(stream)
                yield hashed
            name = posixpath.basename(str(path))
            with self._lock:
                self.digests[name] = FileDigest(name=name, size=hashed.size,
                                                sha256=hashed.digest.hexdigest())

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)  # DCP's .metadata.tmp -> .metadata
            with self._lock:
                digest = self.digests.pop(posixpath.basename(str(path)), None)
                if digest is not None:
                    name = posixpath.basename(str(new_path))
                    self.digests[name] = FileDigest(name=name, size=digest.size,
                                                    sha256=digest.sha256)

    class HashingWriter(FsspecWriter):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = HashingFileSystem()
            self.path = self.fs.init_path(path)

        def written(self) -> list[FileDigest]:
            """Size and SHA-256 of each object this rank has written, by name."""
            return sorted(self.fs.digests.values(), key=lambda d: d.name)

    return HashingWriter(final)


def describe_failure(err: BaseException, final: str, step: int) -> str:
    """One sentence for a save of ``final`` that failed while its shards were written."""
    return _describe(err, final, step)


def seal(url: str, final: str, step: int, *, config_toml: str | None, keep_last: int,
         written: list[FileDigest] | None = None, group: Any = None) -> str:
    """After the shards of ``final`` are written (collective over ``group``): rank 0 writes
    ``config.toml``, then ``manifest.json`` (last), then prunes. Returns ``final``.

    ``written``: this rank's digests of what it wrote (`writer`'s ``written()``); the ranks'
    lists are gathered and, after the store's listing shows each object at the size sent
    (a missing or resized one fails the save, naming it), become the manifest. None (a writer
    that kept no digests) hashes the stored objects instead, read back by rank 0.
    """
    from densetrain.checkpoint.manager import CheckpointError

    gathered = collective.gather_all(written, group)
    failure = None
    if collective.rank() == 0:
        try:
            fs, path = filesystem(final)
            if config_toml is not None:
                fs.pipe_file(f"{path}/{CONFIG_FILE}", config_toml.encode("utf-8"))
            if any(part is None for part in gathered):
                digests = [_digest(final, name) for name in sorted(_files(final))
                           if name != MANIFEST_FILE]
            else:
                digests = _sent_digests(final, gathered, config_toml)
            text = manifest_text(digests, step=step,
                                 config_sha256=sha256_text(config_toml or ""))
            fs.pipe_file(f"{path}/{MANIFEST_FILE}", text.encode("utf-8"))  # last
            if keep_last > 0:
                prune(url, keep_last)
        except Exception as err:
            failure = _describe(err, final, step)
    failure = collective.first_error(failure, group)
    if failure:
        raise CheckpointError(failure)
    return final


def _sent_digests(final: str, gathered: list[list[FileDigest]],
                  config_toml: str | None) -> list[FileDigest]:
    """The ranks' digests of what they sent (and the config's), once the store's listing
    shows exactly those objects at those sizes; otherwise an ``OSError`` naming each
    difference."""
    digests = {d.name: d for part in gathered for d in part}
    if config_toml is not None:
        data = config_toml.encode("utf-8")
        digests[CONFIG_FILE] = FileDigest(name=CONFIG_FILE, size=len(data),
                                          sha256=hashlib.sha256(data).hexdigest())
    stored = {n: size for n, size in _files(final).items() if n != MANIFEST_FILE}
    problems = [f"{n}: missing" for n in sorted(digests) if n not in stored]
    problems += [f"{n}: {stored[n]} bytes stored, {digests[n].size} sent" for n in sorted(digests)
                 if n in stored and stored[n] != digests[n].size]
    problems += [f"{n}: stored, but no rank wrote it" for n in sorted(stored)
                 if n not in digests]
    if problems:
        raise OSError(f"the store does not hold what was written ({'; '.join(problems)})")
    return [digests[n] for n in sorted(digests)]


def save(url: str, step: int, tree: Mapping[str, Any], *, config_toml: str | None,
         keep_last: int) -> str:
    """Write ``tree`` as ``url/step-N`` (collective): shards, config, then the manifest.
    Returns the checkpoint URL. A ``step-N`` whose manifest exists and whose objects have the
    listed sizes is kept as it is (the same step saved twice)."""
    from densetrain.checkpoint.manager import CheckpointError

    final, skip = begin(url, step)
    if skip:
        return final
    try:
        collective.quiet_single_process_notice()
        storage = writer(final)
        dcp.save(tree, storage_writer=storage, no_dist=not collective.dist_on())
    except BaseException as err:
        raise CheckpointError(_describe(err, final, step)) from err
    return seal(url, final, step, config_toml=config_toml, keep_last=keep_last,
                written=storage.written())


def report_skipped(checkpoint: str, damage: list[Damage], more: bool) -> None:
    """Name a checkpoint a resume passes over (rank 0, stderr)."""
    if collective.rank() == 0:
        after = "trying the previous one" if more else "no older checkpoint is left"
        print(f"checkpoint {checkpoint} is damaged or partial ({'; '.join(map(str, damage))}); "
              f"skipped (left in place), {after}", file=sys.stderr)


def open_stream(url: str) -> io.IOBase:
    """A binary read stream of the object at ``url``."""
    fs, path = filesystem(url)
    return fs.open(path, "rb")

