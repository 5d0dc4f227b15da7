"""The embedded default corpus: the Python standard library sources of the running interpreter.

Every machine with Python has it, so ``densetrain train`` needs no data argument. On first use
the ``.py`` files (sorted by relative path, ``site-packages`` excluded) train a byte-level BPE and
are prepared into ``<cache>/stdlib-...``; a file lock makes concurrent first use by several ranks
or jobs safe (one prepares, the others wait and then find the completed ``meta.json``).
"""

from __future__ import annotations

import fcntl
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from densetrain.data.prepare import PrepareConfig, prepare_dataset
from densetrain.data.shards import FORMAT, META_FILE
from densetrain.data.sources import ReadStats, decode_utf8
from densetrain.data.tokenizer import train_tokenizer
from densetrain.errors import UserFileNotFoundError

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_cache_dir(cache_dir: str = "") -> Path:
    """``cache_dir``, else ``$DENSETRAIN_CACHE``, else ``~/.cache/densetrain``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DENSETRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "densetrain"


def stdlib_files(max_files: int = 0) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path; the first ``max_files``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative: list[str] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]  # prune site-packages
        base = Path(directory).relative_to(root)
        relative.extend((base / n).as_posix() for n in names if n.endswith(".py"))
    files = [root / rel for rel in sorted(relative)]
    if not files:
        raise UserFileNotFoundError(f"no standard-library sources found under {root}")
    return files[:max_files] if max_files else files


def _texts(files: list[Path]) -> Iterator[str]:
    stats = ReadStats()
    for path in files:
        yield decode_utf8(path.read_bytes(), stats)


def default_corpus_dir(
    *, cache_dir: str = "", vocab_size: int = 8192, max_files: int = 0, val_fraction: float = 0.02
) -> Path:
    """Where the default corpus of these settings is (or will be) prepared; nothing is made."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    # The shard format is part of the name: a cache written by an older format is not reused.
    tag = FORMAT.rsplit("-", 1)[-1]
    name = f"stdlib-{version}-v{vocab_size}-f{max_files or 'all'}-val{val_fraction:g}-{tag}"
    return default_cache_dir(cache_dir) / name


def ensure_default_corpus(
    *,
    cache_dir: str = "",
    vocab_size: int = 8192,
    max_files: int = 0,
    val_fraction: float = 0.02,
    progress: bool = False,
) -> Path:
    """Directory of the prepared default corpus, preparing it (and its tokenizer) if needed."""
    out = default_corpus_dir(cache_dir=cache_dir, vocab_size=vocab_size, max_files=max_files,
                             val_fraction=val_fraction)
    cache, name = out.parent, out.name
    if (out / META_FILE).is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (out / META_FILE).is_file():  # another process finished while this one waited
            return out
        files = stdlib_files(max_files)
        print(
            f"densetrain: first use of the default corpus: training a {vocab_size}-token BPE and "
            f"preparing {len(files)} standard-library files into {out} (once; cached)",
            file=sys.stderr,
            flush=True,
        )
        tokenizer_path = cache / f"{name}.tokenizer" / "tokenizer.json"  # copied into `out`
        if not tokenizer_path.is_file():
            train_tokenizer(_texts(files), tokenizer_path, vocab_size=vocab_size)
        cfg = PrepareConfig(val_fraction=val_fraction, shard_tokens=1 << 22)
        prepare_dataset(
            [str(p) for p in files], out, tokenizer=tokenizer_path, cfg=cfg, progress=progress
        )
    return out
