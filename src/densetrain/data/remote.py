"""Prepared datasets under an fsspec URL (``s3://bucket/prefix``, ``file:///abs/dir``).

An entry of ``data.datasets`` may be a URL. ``file://PATH`` is the local directory PATH. Any
other scheme goes through fsspec (s3fs for ``s3://``; credentials and endpoint from the standard
AWS variables, as for checkpoints: `checkpoint.objstore`):

* On open, ``meta.json``, the tokenizer and every shard's document index (small) are read into
  ``<data.cache_dir>/remote/meta/<hash of the URL>/``; the index files are checked against the
  ``docs_sha256`` of ``meta.json`` as for a local dataset.
* Token shards are fetched on first use into ``<data.cache_dir>/remote/shards-rank<RANK>/``,
  named by their SHA-256 (a dataset prepared again never reuses a stale copy), to a temporary
  name first and renamed once their SHA-256 matches ``meta.json``: a mismatch is refused (a
  `DamagedFileError` naming the URL and the shard), the bytes are deleted and never read.
* The shard directory holds at most ``data.cache_max_bytes``; the least recently used shard is
  deleted to make room. Each process (``RANK``) has its own directory, so no process deletes a
  file another is reading. A copy found there from an earlier run is hashed again on its first
  use in this process and fetched again when it differs.
* `BatchStream` knows the next batch's rows (the order is a pure function of the position), so
  after each batch it asks for the shards that batch reads: they are fetched in background
  threads while the step runs (as far as the cache bound leaves room).

Batches are read from the same tokens through the same `TokenStore` code as a local dataset, so
the order and the resume state (which holds no path) are identical.

fsspec/s3fs do the transfers (with their retries); written here is what they do not: the
verified, size-bounded, least-recently-used cache and the lookahead, since fsspec's own caching
filesystems (``filecache``/``simplecache``) neither bound the size nor check a checksum.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from densetrain.data.default_corpus import default_cache_dir
from densetrain.data.shards import META_FILE, atomic_write_bytes, load_metadata
from densetrain.errors import DamagedFileError, UserError, UserFileExistsError
from densetrain.storage_url import (
    _URL_RE,
    EXTRA_HINT,
    bucket_problem,
    is_remote,
    url_problem,
    url_scheme,
)

DEFAULT_CACHE_MAX_BYTES = 20 << 30
_CHUNK = 8 << 20
_PREFETCH_THREADS = 4


class RemoteDatasetError(UserError):
    """A dataset URL cannot be used (malformed, unknown scheme, missing package or bucket, no
    ``meta.json`` there)."""


def local_dataset_path(value: str) -> Path | None:
    """The local directory of a dataset entry (a path or ``file://`` URL); None for a remote
    URL."""
    scheme = url_scheme(value)
    if scheme is None:
        return Path(value)
    if scheme == "file":
        return Path(_URL_RE.match(value).group(2))
    return None


def _url_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _filesystem(url: str, field: str) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        raise RemoteDatasetError(f"{field} {url} needs a package that is not installed "
                                 f"({err.name or err}): {EXTRA_HINT}") from None
    except ValueError as err:
        raise RemoteDatasetError(f"{field} {url}: {err}") from None


def _reachable(url: str, field: str) -> tuple[str, Any, str]:
    """``url`` without a trailing slash, its filesystem and path, once the URL is well formed
    and its bucket answers (else one `RemoteDatasetError` naming ``field`` and the URL)."""
    problem = url_problem(field, url)
    if problem is not None:
        raise RemoteDatasetError(problem)
    url = url.rstrip("/")
    fs, path = _filesystem(url, field)
    problem = bucket_problem(fs, path, url, field)
    if problem is not None:
        raise RemoteDatasetError(problem)
    return url, fs, path


class ShardCache:
    """Verified copies of token shards in a directory of at most ``max_bytes``, least recently
    used first out; fetches run in background threads when asked ahead (`prefetch`)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._lru: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, oldest first
        self._arrays: dict[str, np.ndarray] = {}
        self._verified: set[str] = set()
        self._pending: dict[str, Future] = {}
        self._reserved = 0
        self._pool = ThreadPoolExecutor(_PREFETCH_THREADS, thread_name_prefix="shard-fetch")
        self.fetches = 0  # downloads done (for tests and reports)
        found = [p for p in directory.iterdir() if p.is_file()]
        for path in sorted(found, key=lambda p: p.stat().st_mtime):
            if path.suffix == ".bin" and len(path.stem) == 64:
                self._lru[path.stem] = path.stat().st_size
            else:  # a download cut short by the end of an earlier process
                path.unlink(missing_ok=True)
        self._evict_down_to(max_bytes)

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return sum(self._lru.values())

    def cached(self) -> set[str]:
        """The SHA-256 of every shard held now."""
        with self._cond:
            return set(self._lru)

    def _path(self, sha: str) -> Path:
        return self.directory / f"{sha}.bin"

    def _evict_down_to(self, limit: int, keep: str | None = None) -> bool:
        """Delete least recently used shards (not ``keep``) until ``limit`` bytes are held
        (lock held). False when that cannot be reached."""
        while sum(self._lru.values()) + self._reserved > limit:
            victim = next((s for s in self._lru if s != keep), None)
            if victim is None:
                return False
            del self._lru[victim]
            self._arrays.pop(victim, None)  # a reader holding the map keeps it (POSIX unlink)
            self._verified.discard(victim)
            self._path(victim).unlink(missing_ok=True)
        return True

    def array(self, shard: RemoteShard) -> np.ndarray:
        """The shard's tokens (memory-mapped), fetched and verified first when needed."""
        with self._cond:
            if shard.sha256 in self._arrays:
                self._lru.move_to_end(shard.sha256)
                return self._arrays[shard.sha256]
            pending = self._pending.get(shard.sha256)
        if pending is not None:
            pending.result()  # a background fetch of it: wait, its error is this read's
        while True:
            self._fetch(shard, wait=True)
            with self._cond:  # a prefetch may have evicted it since: then fetch it again
                if shard.sha256 in self._lru:
                    array = np.memmap(self._path(shard.sha256), dtype=shard.dtype, mode="r")
                    self._arrays[shard.sha256] = array
                    self._lru.move_to_end(shard.sha256)
                    return array

    def prefetch(self, shards: list[RemoteShard]) -> None:
        """Fetch ``shards`` in the background (those not held or under way)."""
        with self._cond:
            for shard in shards:
                if shard.sha256 in self._lru or shard.sha256 in self._pending:
                    continue
                future = self._pool.submit(self._fetch, shard, wait=False)
                self._pending[shard.sha256] = future
                future.add_done_callback(lambda _f, s=shard.sha256: self._done(s))

    def _done(self, sha: str) -> None:
        with self._cond:
            self._pending.pop(sha, None)

    def _fetch(self, shard: RemoteShard, *, wait: bool) -> None:
        """Make ``shard`` present and verified. ``wait=False`` (a prefetch) gives up when the
        cache has no room without deleting a shard being fetched; the reader then fetches it."""
        sha = shard.sha256
        with self._cond:
            if sha in self._lru:
                if sha in self._verified:
                    return
                held = True
            else:
                held = False
        if held:  # from an earlier process: hash it again before the first use here
            if _file_sha256(self._path(sha)) == sha:
                with self._cond:
                    self._verified.add(sha)
                return
            print(f"cached copy of shard {shard.url} in {self.directory} does not match its "
                  "SHA-256; fetching it again", file=sys.stderr)
            with self._cond:
                self._lru.pop(sha, None)
                self._path(sha).unlink(missing_ok=True)
        with self._cond:
            while not self._evict_down_to(self.max_bytes - shard.nbytes, keep=sha):
                if not wait:
                    return
                self._cond.wait()
            self._reserved += shard.nbytes
        try:
            self._download(shard)
        finally:
            with self._cond:
                self._reserved -= shard.nbytes
                self._cond.notify_all()

    def _download(self, shard: RemoteShard) -> None:
        tmp = self.directory / f"{shard.sha256}.{threading.get_ident()}.tmp"
        digest, size = hashlib.sha256(), 0
        try:
            with shard.fs.open(shard.path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
            if size != shard.nbytes or digest.hexdigest() != shard.sha256:
                what = (f"{size} bytes, expected {shard.nbytes}" if size != shard.nbytes else
                        f"SHA-256 {digest.hexdigest()[:16]}..., expected {shard.sha256[:16]}...")
                raise DamagedFileError(
                    f"shard {shard.file} of dataset {shard.dataset} ({shard.url}) does not match "
                    f"its entry in {shard.dataset}/{META_FILE} ({what}); refused, not used: the "
                    "object was changed or damaged on the store: upload it again or prepare the "
                    "dataset again")
            os.replace(tmp, self._path(shard.sha256))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._cond:
            self._lru[shard.sha256] = size
            self._verified.add(shard.sha256)
            self.fetches += 1


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class RemoteShard:
    """One token shard of a remote dataset."""

    dataset: str
    file: str
    fs: Any
    path: str
    sha256: str
    nbytes: int
    dtype: np.dtype

    @property
    def url(self) -> str:
        return f"{self.dataset}/{self.file}"


class RemoteSplit:
    """The token shards of one split of a remote dataset, as `TokenStore` reads them."""

    def __init__(self, dataset: RemoteDataset, split: str) -> None:
        meta = dataset.meta
        dtype = np.dtype(meta["dtype"])
        self.cache = dataset.cache
        self.shards = [
            RemoteShard(dataset=dataset.url, file=e["file"], fs=dataset.fs,
                        path=f"{dataset.path}/{e['file']}", sha256=e["sha256"],
                        nbytes=e["num_tokens"] * dtype.itemsize, dtype=dtype)
            for e in meta["splits"].get(split, {}).get("shards", [])
        ]

    def name(self, index: int) -> str:
        return self.shards[index].url

    def array(self, index: int) -> np.ndarray:
        return self.cache.array(self.shards[index])

    def prefetch(self, indices: list[int]) -> None:
        self.cache.prefetch([self.shards[i] for i in indices])


@dataclass
class RemoteDataset:
    """A prepared dataset under a URL, its metadata read into the local ``root``."""

    url: str
    fs: Any
    path: str
    root: Path
    meta: dict
    cache: ShardCache

    def split(self, name: str) -> RemoteSplit:
        return RemoteSplit(self, name)


_CACHES: dict[tuple[str, int], ShardCache] = {}
_LOCK = threading.Lock()


def shard_cache(cache_dir: str, max_bytes: int) -> ShardCache:
    """This process's shard cache under ``cache_dir`` (`default_cache_dir` when empty)."""
    rank = os.environ.get("RANK", "0")
    directory = default_cache_dir(cache_dir) / "remote" / f"shards-rank{rank}"
    key = (str(directory.resolve()), max_bytes)
    with _LOCK:
        if key not in _CACHES:
            _CACHES[key] = ShardCache(directory, max_bytes)
        return _CACHES[key]


def open_remote_dataset(url: str, *, cache_dir: str = "",
                        cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES,
                        field: str = "data.datasets") -> RemoteDataset:
    """Check ``url`` (one `RemoteDatasetError` naming it), read its ``meta.json``, tokenizer and
    document indexes into the local cache; shards are fetched on use."""
    url, fs, path = _reachable(url, field)
    try:
        meta_bytes = fs.cat_file(f"{path}/{META_FILE}")
    except FileNotFoundError:
        raise RemoteDatasetError(
            f"{field} {url} holds no {META_FILE}: not a prepared dataset, or one whose upload "
            "has not finished (`densetrain data prepare --output URL` writes it last)") from None
    root = default_cache_dir(cache_dir) / "remote" / "meta" / _url_hash(url)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(root / META_FILE, meta_bytes)
    try:
        meta = load_metadata(root)
    except (UserError, OSError) as err:
        raise DamagedFileError(f"{field} {url}: {err}") from None
    if meta.get("format") != "densetrain-tokens-v2":
        raise RemoteDatasetError(f"{field} {url} was prepared without shard checksums; a "
                                 "remote dataset needs them: prepare it again")
    wanted = [meta["tokenizer"]["file"]]
    for split in meta["splits"].values():
        for entry in split["shards"]:
            local = root / entry["docs"]
            if not (local.is_file() and _file_sha256(local) == entry["docs_sha256"]):
                wanted.append(entry["docs"])
    fetched = fs.cat([f"{path}/{name}" for name in wanted], on_error="return")  # concurrent
    for name in wanted:
        data = fetched.get(f"{path}/{name}")
        if isinstance(data, BaseException):
            raise DamagedFileError(f"{field} {url}: {name} cannot be read ({type(data).__name__}"
                                   f": {data}); {META_FILE} lists it") from None
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(root / name, data)
    dtype = np.dtype(meta["dtype"])
    largest = max((e["num_tokens"] * dtype.itemsize for s in meta["splits"].values()
                   for e in s["shards"]), default=0)
    if largest > cache_max_bytes:
        raise RemoteDatasetError(
            f"{field} {url} has a shard of {largest} bytes, more than "
            f"data.cache_max_bytes={cache_max_bytes}; raise data.cache_max_bytes")
    return RemoteDataset(url=url, fs=fs, path=path, root=root, meta=meta,
                         cache=shard_cache(cache_dir, cache_max_bytes))


@dataclass
class DatasetSource:
    """One ``data.datasets`` entry opened: the local directory holding its ``meta.json``, the
    name it goes by (the entry itself), and its remote side (None for a local dataset)."""

    root: Path
    name: str
    remote: RemoteDataset | None


def resolve_dataset(entry: str, cfg) -> DatasetSource:
    """``entry`` of ``cfg.datasets`` (a `DataConfig`) as a `DatasetSource`; a remote URL is
    opened (`open_remote_dataset`)."""
    local = local_dataset_path(entry)
    if local is not None:
        return DatasetSource(root=local, name=entry, remote=None)
    remote = open_remote_dataset(entry, cache_dir=cfg.cache_dir,
                                 cache_max_bytes=cfg.cache_max_bytes)
    return DatasetSource(root=remote.root, name=remote.url, remote=remote)


# --- prepare to a URL ---------------------------------------------------------------------


def prepare_to_url(prepare, inputs: list[str], url: str, *, overwrite: bool = False,
                   **kwargs) -> dict | None:
    """Run ``prepare`` (`prepare_dataset` or the parallel one) into a local staging directory
    (``<cache>/remote/prepare/<hash of the URL>``, so an interrupted run resumes), then upload
    it: every file, then ``meta.json`` last, so the dataset is visible only when complete. An
    existing dataset there is refused unless ``overwrite``, which deletes its ``meta.json``
    first (it is not a dataset while the new files go up)."""
    field = "--output"
    url, fs, path = _reachable(url, field)
    meta_path = f"{path}/{META_FILE}"
    fs.invalidate_cache()
    if fs.exists(meta_path) and not overwrite:
        raise UserFileExistsError(f"{url} is already a prepared dataset; choose another --output "
                                  "or replace it with --overwrite (overwrite=True in Python)")
    staging = default_cache_dir("") / "remote" / "prepare" / _url_hash(url)
    if (staging / META_FILE).exists():  # prepared, then the upload failed: start again clean
        shutil.rmtree(staging)
    meta = prepare(inputs, staging, **kwargs)  # an interrupted staging prepare resumes
    if meta is None:
        return None
    if fs.exists(meta_path):
        fs.rm_file(meta_path)
    files = sorted(p for p in staging.rglob("*") if p.is_file() and p.name != META_FILE)
    fs.put([str(p) for p in files],
           [f"{path}/{p.relative_to(staging).as_posix()}" for p in files])  # concurrent
    fs.put_file(str(staging / META_FILE), meta_path)  # last: now the dataset is complete
    shutil.rmtree(staging)
    return meta


def is_url(value: object) -> bool:
    """True for any ``scheme://`` string (``file://`` included)."""
    return url_scheme(value) is not None


__all__ = ["DEFAULT_CACHE_MAX_BYTES", "RemoteDataset", "RemoteDatasetError", "ShardCache",
           "is_remote", "is_url", "local_dataset_path", "open_remote_dataset", "prepare_to_url",
           "resolve_dataset", "shard_cache"]
