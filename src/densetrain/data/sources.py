"""Raw inputs: expand paths, directories and globs; stream documents from text, JSONL, Parquet.

Documents are streamed one at a time (flat memory). Bytes that are not valid UTF-8 are replaced
with U+FFFD and counted; malformed JSONL lines either fail with file and line number or are
skipped and counted (``on_bad_line``).
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_COMPRESSION_SUFFIXES = (".gz", ".zst")
_READ_BLOCK = 1 << 20


@dataclass(kw_only=True)
class ReadStats:
    """What reading found: documents, replaced bytes, skipped lines (with their first places)."""

    documents: int = 0
    invalid_utf8_documents: int = 0
    replaced_bytes: int = 0
    skipped_lines: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Plain-JSON form for metadata."""
        return {
            "documents": self.documents,
            "invalid_utf8_documents": self.invalid_utf8_documents,
            "replaced_bytes": self.replaced_bytes,
            "skipped_lines": self.skipped_lines,
            "skipped_examples": list(self.skipped_examples),
        }


class _ReplacementCounter:
    """A codecs error handler that replaces undecodable bytes with U+FFFD and counts them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, error: UnicodeError) -> tuple[str, int]:
        assert isinstance(error, UnicodeDecodeError)
        self.count += error.end - error.start
        return "\ufffd", error.end


_COUNTER = _ReplacementCounter()
codecs.register_error("densetrain_count_replace", _COUNTER)


def decode_utf8(raw: bytes, stats: ReadStats) -> str:
    """Decode ``raw`` as UTF-8, replacing (and counting in ``stats``) invalid bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        before = _COUNTER.count
        text = raw.decode("utf-8", errors="densetrain_count_replace")
        stats.invalid_utf8_documents += 1
        stats.replaced_bytes += _COUNTER.count - before
        return text


def input_kind(path: Path) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"`` from the file name (compression suffix ignored)."""
    name = path.name.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files named by ``inputs`` (files, directories recursed, globs), sorted within each entry.

    Raises ``FileNotFoundError`` for a path that does not exist or a glob that matches nothing.
    Hidden files (names starting with ``.``) inside directories are skipped.
    """
    if not inputs:
        raise ValueError("inputs: no input paths given")
    files: list[Path] = []
    for entry in inputs:
        if any(ch in entry for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(entry, recursive=True))
            matched_files = [p for p in matches if p.is_file()]
            if not matched_files:
                raise FileNotFoundError(f"input glob {entry!r} matches no files")
            files.extend(matched_files)
            continue
        path = Path(entry)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise FileNotFoundError(f"input directory {entry!r} contains no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input path {entry!r} does not exist")
    return files


def _open_binary(path: Path) -> BinaryIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 - closed through the stream reader
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")  # noqa: SIM115


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (as stored, compressed or not)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _bad_line(stats: ReadStats, on_bad_line: str, where: str, why: str) -> None:
    message = f"{where}: {why}"
    if on_bad_line == "error":
        raise ValueError(f"{message} (pass on_bad_line='skip' / --skip-bad-lines to skip)")
    stats.skipped_lines += 1
    if len(stats.skipped_examples) < 10:
        stats.skipped_examples.append(message)


def _iter_jsonl(path: Path, text_field: str, on_bad_line: str, stats: ReadStats) -> Iterator[str]:
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(decode_utf8(raw, stats))
            except json.JSONDecodeError as e:
                _bad_line(stats, on_bad_line, where, f"malformed JSON ({e.msg})")
                continue
            if not isinstance(record, dict):
                _bad_line(stats, on_bad_line, where, "line is not a JSON object")
                continue
            if text_field not in record:
                keys = sorted(record)[:10]
                _bad_line(stats, on_bad_line, where, f"no field {text_field!r} (has {keys})")
                continue
            value = record[text_field]
            if not isinstance(value, str):
                _bad_line(stats, on_bad_line, where, f"field {text_field!r} is not a string")
                continue
            yield value


def _iter_text(path: Path, separator: str, stats: ReadStats) -> Iterator[str]:
    """The whole file as one document, or its pieces between ``separator``s, streamed."""
    with _open_binary(path) as f:
        if not separator:
            yield decode_utf8(f.read(), stats)
            return
        sep = separator.encode("utf-8")
        pending = b""
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            pieces = (pending + block).split(sep)
            pending = pieces.pop()
            for piece in pieces:
                yield decode_utf8(piece, stats)
        yield decode_utf8(pending, stats)


def _iter_parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if column not in names:
        raise ValueError(f"parquet file {path} has no column {column!r}; columns: {names}")
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value if isinstance(value, str) else str(value)


def iter_documents(
    files: list[Path],
    *,
    text_field: str = "text",
    on_bad_line: str = "error",
    text_separator: str = "",
    stats: ReadStats,
) -> Iterator[str]:
    """Stream documents: a JSONL line or Parquet row is one; a text file is one, or, with
    ``text_separator`` (e.g. ``"\\n\\n"``), each piece between separators is one."""
    if on_bad_line not in ("error", "skip"):
        raise ValueError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
    for path in files:
        kind = input_kind(path)
        if kind == "jsonl":
            documents: Iterator[str] = _iter_jsonl(path, text_field, on_bad_line, stats)
        elif kind == "parquet":
            documents = _iter_parquet(path, text_field)
        else:
            documents = _iter_text(path, text_separator, stats)
        for text in documents:
            stats.documents += 1
            yield text


def describe_sources(files: list[Path]) -> list[dict]:
    """Path, size and SHA-256 of each input file (recorded in metadata, checked on resume)."""
    return [
        {
            "path": str(p),
            "bytes": os.path.getsize(p),
            "sha256": file_sha256(p),
            "kind": input_kind(p),
        }
        for p in files
    ]
