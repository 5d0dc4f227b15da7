"""Checkpoint manifests: the size and SHA-256 of every file, written last, checked before trust.

``manifest.json`` lists every file of a checkpoint directory (DCP shards, ``.metadata``,
``config.toml``) with its byte size and SHA-256, plus the SHA-256 of the run's resolved config.
It is written into the ``.tmp`` directory after every other file and before the rename that
makes the checkpoint visible, so a visible checkpoint without a verifying manifest is damaged.

Hashing streams each file through ``hashlib.file_digest`` (no whole-file buffer; hashlib drops
the GIL on large blocks, so the files of a checkpoint are hashed on several threads at once).
DCP itself stores no checksums, which is why this layer exists.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densetrain.values import is_int_at_least

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "densetrain-checkpoint-manifest/1"
_HASH_THREADS = 4


@dataclass(kw_only=True, frozen=True)
class FileDigest:
    """Size in bytes and SHA-256 (hex) of one file, named relative to its checkpoint."""

    name: str
    size: int
    sha256: str


@dataclass(kw_only=True, frozen=True)
class Damage:
    """What is wrong with one file of a checkpoint (``file`` is relative to the checkpoint)."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


def sha256_text(text: str) -> str:
    """SHA-256 (hex) of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def digest_file(directory: Path, name: str) -> FileDigest:
    """Stream ``directory/name`` through SHA-256."""
    path = directory / name
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return FileDigest(name=name, size=path.stat().st_size, sha256=digest)


def _on_threads(work: Callable[[str], Any], names: Iterable[str]) -> list[Any]:
    """``work`` of each name, in order, on a few threads (hashlib drops the GIL)."""
    names = list(names)
    if len(names) <= 1:
        return [work(n) for n in names]
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(names))) as pool:
        return list(pool.map(work, names))


def digest_files(directory: Path, names: Iterable[str]) -> list[FileDigest]:
    """`digest_file` of each name, on a few threads."""
    return _on_threads(lambda n: digest_file(directory, n), names)


def checkpoint_files(directory: Path) -> list[str]:
    """Names of the regular files a manifest covers (every file but the manifest), sorted."""
    return sorted(
        p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE
    )


def share_of(names: list[str], rank: int, world_size: int) -> list[str]:
    """The names this rank hashes: every ``world_size``-th one starting at ``rank``."""
    return names[rank::world_size]


def manifest_text(digests: Iterable[FileDigest], *, step: int, config_sha256: str) -> str:
    """The manifest as JSON text."""
    files = {d.name: {"bytes": d.size, "sha256": d.sha256} for d in sorted(
        digests, key=lambda d: d.name)}
    body = {"format": MANIFEST_FORMAT, "step": step, "config_sha256": config_sha256,
            "files": files}
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


def read_manifest(checkpoint: Path) -> tuple[dict[str, Any] | None, Damage | None]:
    """The parsed manifest of ``checkpoint``, or the damage that keeps it from being read."""
    path = checkpoint / MANIFEST_FILE
    if not path.is_file():
        return None, Damage(file=MANIFEST_FILE, problem="missing (the checkpoint cannot be "
                            "verified: it was emptied, or written before manifests existed)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return None, Damage(file=MANIFEST_FILE, problem=f"unreadable ({err})")
    return parse_manifest(text)


def parse_manifest(text: str) -> tuple[dict[str, Any] | None, Damage | None]:
    """The manifest in ``text``, or the damage that keeps it from being one."""
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        return None, Damage(file=MANIFEST_FILE, problem=f"unreadable ({err})")
    problem = _schema_problem(manifest)
    if problem is not None:
        return None, Damage(file=MANIFEST_FILE, problem=f"not a {MANIFEST_FORMAT} manifest "
                            f"({problem})")
    return manifest, None


_SHA256_HEX = frozenset("0123456789abcdef")


def _schema_problem(manifest: Any) -> str | None:
    """What keeps ``manifest`` (parsed JSON) from being a manifest this module wrote, or None.

    Checked whole before any value is used: a file name must be a plain name inside the
    checkpoint (no ``/``, ``..``), sizes are integers >= 0, digests 64 lower-case hex digits.
    """
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"format is {manifest.get('format')!r}"
    step = manifest.get("step")
    if not is_int_at_least(step, 0):
        return f"step is {step!r}, not an integer >= 0"
    if not isinstance(manifest.get("config_sha256"), str):
        return "config_sha256 is not a string"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "files is not an object"
    for name, entry in files.items():
        if not name or "/" in name or "\\" in name or name in (".", "..", MANIFEST_FILE):
            return f"file name {name!r} is not a plain file name"
        if not isinstance(entry, dict):
            return f"files[{name!r}] is not an object"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not is_int_at_least(size, 0):
            return f"files[{name!r}].bytes is {size!r}, not an integer >= 0"
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256_HEX):
            return f"files[{name!r}].sha256 is not 64 hex digits"
    return None


def check_sizes(checkpoint: Path, manifest: dict[str, Any]) -> list[Damage]:
    """Files listed but missing or of another size, and files present but not listed."""
    damage = []
    listed = manifest["files"]
    for name, entry in sorted(listed.items()):
        path = checkpoint / name
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError:  # removed between the two looks (a concurrent prune)
            size = None
        if size is None:
            damage.append(Damage(file=name, problem="missing"))
        elif size != entry["bytes"]:
            damage.append(Damage(file=name, problem=f"{size} bytes, the manifest says "
                                 f"{entry['bytes']} (truncated or overwritten)"))
    try:
        present = checkpoint_files(checkpoint)
    except OSError:  # the directory itself was removed meanwhile
        return damage or [Damage(file=".", problem="the checkpoint directory is gone")]
    for name in present:
        if name not in listed:
            damage.append(Damage(file=name, problem="not listed in the manifest"))
    return damage


def check_hashes(checkpoint: Path, manifest: dict[str, Any], names: list[str]) -> list[Damage]:
    """Files among ``names`` whose SHA-256 differs from the manifest's (sizes already match)."""
    damage = []

    def digest_or_error(name: str) -> FileDigest | Damage:
        try:
            return digest_file(checkpoint, name)
        except OSError as err:  # removed by a concurrent prune, no permission, an I/O error
            return Damage(file=name, problem=f"unreadable ({err.strerror or err})")

    for digest in _on_threads(digest_or_error, names):
        if isinstance(digest, Damage):
            damage.append(digest)
            continue
        expected = manifest["files"][digest.name]["sha256"]
        if digest.sha256 != expected:
            damage.append(Damage(file=digest.name, problem=f"SHA-256 {digest.sha256[:16]}... "
                                 f"differs from the manifest's {expected[:16]}... (bytes "
                                 "changed on disk)"))
    return damage


def write_manifest_file(directory: Path, text: str) -> None:
    """Write ``manifest.json`` into ``directory`` durably (temporary name, fsync, rename)."""
    path = directory / MANIFEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
