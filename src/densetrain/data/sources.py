"""Raw inputs: expand paths, directories and globs; stream documents from text, JSONL, Parquet.

Documents are streamed one at a time (flat memory). Bytes that are not valid UTF-8 are replaced
with U+FFFD and counted; malformed JSONL lines either fail with file and line number or are
skipped and counted (``on_bad_line``). A text input whose content is binary (an image, an
archive, a compiled file, whatever its name) is skipped and counted, judged by its first bytes.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from densetrain.errors import UserError

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_COMPRESSION_SUFFIXES = (".gz", ".zst")
_READ_BLOCK = 1 << 20
_SNIFF_BYTES = 8000
# Control characters that do not occur in text (tab, newline, form feed, CR and ESC do).
_BINARY_CONTROL = bytes(set(range(32)) - {8, 9, 10, 12, 13, 27})
_MAX_CONTROL_FRACTION = 0.1
_MAX_INVALID_UTF8_FRACTION = 0.3


@dataclass(kw_only=True)
class ReadStats:
    """What reading found: documents, replaced bytes, skipped lines (with their first places)."""

    documents: int = 0
    invalid_utf8_documents: int = 0
    replaced_bytes: int = 0
    skipped_lines: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    skipped_binary_files: int = 0
    skipped_binary_examples: list[str] = field(default_factory=list)

    def skipped_note(self) -> str:
        """`` (2 binary files skipped, 1 bad lines skipped)``, or "" when nothing was skipped."""
        skipped = [f"{count} {what} skipped" for count, what in (
            (self.skipped_binary_files, "binary files"), (self.skipped_lines, "bad lines"))
            if count]
        return f" ({', '.join(skipped)})" if skipped else ""

    def as_dict(self) -> dict:
        """Plain-JSON form for metadata."""
        return {
            "documents": self.documents,
            "invalid_utf8_documents": self.invalid_utf8_documents,
            "replaced_bytes": self.replaced_bytes,
            "skipped_lines": self.skipped_lines,
            "skipped_examples": list(self.skipped_examples),
            "skipped_binary_files": self.skipped_binary_files,
            "skipped_binary_examples": list(self.skipped_binary_examples),
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


def binary_reason(head: bytes) -> str | None:
    """Why the first bytes of a file show binary content, or None for text.

    Git's rule (a NUL byte in the first 8000 bytes means binary), plus two checks for binary
    data without NULs: many control characters, or mostly invalid UTF-8. Hand-written because it
    is three lines; libraries that sniff file types go by magic numbers, not by "is this text".
    """
    if not head:
        return None
    if b"\0" in head:
        return "binary content (NUL bytes)"
    control = sum(head.count(bytes([c])) for c in _BINARY_CONTROL)
    if control > _MAX_CONTROL_FRACTION * len(head):
        return f"binary content ({control} control bytes in the first {len(head)})"
    invalid = len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))
    if invalid > _MAX_INVALID_UTF8_FRACTION * len(head) + 4:  # + 4: a character cut at the end
        return f"binary content ({invalid} of the first {len(head)} bytes are not UTF-8)"
    return None


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
                raise FileNotFoundError(
                    f"input glob {entry!r} matches no files; check the pattern (quote it so "
                    "the shell does not expand it)"
                )
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
                raise FileNotFoundError(
                    f"input directory {entry!r} contains no files (hidden files are skipped)"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(
                f"input path {entry!r} does not exist; give text, JSONL or Parquet files, "
                "directories or globs"
            )
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
        raise UserError(
            f"{message}; each line must be a JSON object with a string text field (pass "
            "--on-bad-line=skip, or on_bad_line='skip' in Python, to skip and count such lines)"
        )
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


def _skip_binary(path: Path, reason: str, stats: ReadStats) -> None:
    stats.skipped_binary_files += 1
    if len(stats.skipped_binary_examples) < 10:
        stats.skipped_binary_examples.append(f"{path}: {reason}")


def _iter_text(path: Path, separator: str, stats: ReadStats) -> Iterator[str]:
    """The whole file as one document, or its pieces between ``separator``s, streamed.

    A file whose first bytes are binary (`binary_reason`) yields nothing and is counted.
    """
    with _open_binary(path) as f:
        head = f.read(_SNIFF_BYTES)
        reason = binary_reason(head)
        if reason is not None:
            _skip_binary(path, reason, stats)
            return
        if not separator:
            yield decode_utf8(head + f.read(), stats)
            return
        sep = separator.encode("utf-8")
        pending = b""
        blocks = itertools.chain([head], iter(lambda: f.read(_READ_BLOCK), b""))
        for block in blocks:
            pieces = (pending + block).split(sep)
            pending = pieces.pop()
            for piece in pieces:
                yield decode_utf8(piece, stats)
        yield decode_utf8(pending, stats)


def _iter_parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's own error types; the message says what is wrong
        raise UserError(f"{path} is not a readable Parquet file: {error}") from error
    names = parquet.schema_arrow.names
    if column not in names:
        raise UserError(
            f"parquet file {path} has no column {column!r}; columns: {names} (choose one with "
            "--text-field)"
        )
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
        try:
            for text in documents:
                stats.documents += 1
                yield text
        except (OSError, EOFError) as error:  # a damaged .gz/.zst, an unreadable file
            raise UserError(f"input file {path} could not be read: {error}") from error


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
