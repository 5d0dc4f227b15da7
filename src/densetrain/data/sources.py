"""Raw inputs: expand paths, directories and globs; stream documents from text, JSONL, Parquet.

Documents are streamed one at a time (flat memory). Bytes that are not valid UTF-8 are replaced
with U+FFFD and counted; malformed JSONL lines (and null Parquet text) either fail with file and
line (row) number or are skipped and counted (``on_bad_line``). A text input whose content is
binary (an image, an archive, a compiled file, whatever its name) is skipped and counted, judged
by its first bytes. A truncated or damaged ``.gz`` / ``.zst`` file is an error.
"""

from __future__ import annotations

import codecs
import errno
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from densetrain.errors import UserError, UserFileNotFoundError

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_COMPRESSION_SUFFIXES = (".gz", ".zst")
_READ_BLOCK = 1 << 20
_SNIFF_BYTES = 8000
# Control characters that do not occur in text (tab, newline, form feed, CR and ESC do).
_BINARY_CONTROL = bytes(set(range(32)) - {8, 9, 10, 12, 13, 27})
_MAX_CONTROL_FRACTION = 0.1
_MAX_INVALID_UTF8_FRACTION = 0.3
_ZSTD_READ_BLOCK = 1 << 16  # compressed bytes per step (text expands ~3-10x)
# A surrogate left in a str by a JSON \uXXXX escape that is not half of a pair.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_JSONL_RULE = "each line must be a JSON object with a string text field"


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

    Raises ``FileNotFoundError`` for a path that does not exist, a glob that matches nothing, or
    a directory holding an entry that is neither a file nor a directory (a broken symbolic
    link, a loop, a FIFO). Hidden files (names starting with ``.``) inside directories are
    skipped.
    """
    if not inputs:
        raise UserError("inputs: no input paths given")
    files: list[Path] = []
    for entry in inputs:
        if any(ch in entry for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(entry, recursive=True))
            matched_files = [p for p in matches if p.is_file()]
            if not matched_files:
                raise UserFileNotFoundError(
                    f"input glob {entry!r} matches no files; check the pattern (quote it so "
                    "the shell does not expand it)"
                )
            files.extend(matched_files)
            continue
        path = Path(entry)
        if path.is_dir():
            entries = [p for p in path.rglob("*")
                       if not any(part.startswith(".") for part in p.relative_to(path).parts)]
            # A broken link, a loop or a FIFO inside a directory is named, not skipped unseen.
            odd = sorted(p for p in entries if not p.is_file() and not p.is_dir())
            if odd:
                more = f" ({len(odd)} such entries, the first named)" if len(odd) > 1 else ""
                raise UserFileNotFoundError(
                    f"{_not_an_input(str(odd[0]), odd[0])}; it is inside input directory "
                    f"{entry!r}{more}: remove or repair it, or name the files to read"
                )
            found = sorted(p for p in entries if p.is_file())
            if not found:
                raise UserFileNotFoundError(
                    f"input directory {entry!r} contains no files (hidden files are skipped)"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UserFileNotFoundError(_not_an_input(entry, path))
    return files


def _not_an_input(entry: str, path: Path) -> str:
    """Why ``path`` (neither a file nor a directory) cannot be read: a broken symbolic link,
    a symlink loop, a missing path, one that cannot be looked at, or a special file."""
    allowed = "give text, JSONL or Parquet files, directories or globs"
    if path.is_symlink():
        target = os.readlink(path)
        try:
            os.stat(path)
        except OSError as error:
            if error.errno == errno.ELOOP:
                return (f"input path {entry!r} is a symbolic link loop (it points to {target!r}, "
                        f"which leads back to itself); {allowed}")
        return (f"input path {entry!r} is a broken symbolic link: it points to {target!r}, "
                f"which does not exist; {allowed}")
    try:
        os.stat(path)
    except FileNotFoundError:
        return f"input path {entry!r} does not exist; {allowed}"
    except OSError as error:  # a parent that is a file, a directory without permission, ...
        return f"input path {entry!r} cannot be looked at ({error.strerror}); {allowed}"
    return (f"input path {entry!r} is not a regular file or directory (a device, FIFO or "
            f"socket); {allowed}")


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file, frame after frame.

    ``zstandard``'s ``stream_reader`` ends silently where a truncated file ends; here a file
    that ends inside a frame raises ``EOFError``, and bytes that are not zstd ``OSError`` (the
    messages gzip gives for the same damage are alike).
    """

    def __init__(self, path: Path) -> None:
        import zstandard

        self._zstd = zstandard
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._frame = None  # the decompressobj of the frame being read, None between frames
        self._input = b""  # compressed bytes not yet given to a decompressor
        self._output = b""  # decompressed bytes, returned up to _offset
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._offset == len(self._output):
            if not self._input:
                self._input = self._file.read(_ZSTD_READ_BLOCK)
                if not self._input:
                    if self._frame is not None:
                        raise EOFError("the file is truncated (the zstd stream ends inside a "
                                       "frame)")
                    return 0
            if self._frame is None:
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
            try:
                self._output, self._offset = self._frame.decompress(self._input), 0
            except self._zstd.ZstdError as error:
                raise OSError(f"not a valid zstd stream ({error})") from error
            if self._frame.eof:  # the frame ended; what follows is the next frame, if any
                self._input, self._frame = self._frame.unused_data, None
            else:
                self._input = b""
        count = min(len(buffer), len(self._output) - self._offset)
        buffer[:count] = memoryview(self._output)[self._offset : self._offset + count]
        self._offset += count
        return count

    def readall(self) -> bytes:
        """The rest of the stream (in large steps: the default's 8 KiB reads are slow)."""
        chunks = []
        while chunk := self.read(_READ_BLOCK):
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_binary(path: Path) -> BinaryIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path), buffer_size=_READ_BLOCK)
    return open(path, "rb")  # noqa: SIM115


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (as stored, compressed or not)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _bad_line(stats: ReadStats, on_bad_line: str, where: str, why: str,
              rule: str = _JSONL_RULE) -> None:
    message = f"{where}: {why}"
    if on_bad_line == "error":
        raise UserError(
            f"{message}; {rule} (pass --on-bad-line=skip, or on_bad_line='skip' in Python, to "
            "skip and count such lines)"
        )
    stats.skipped_lines += 1
    if len(stats.skipped_examples) < 10:
        stats.skipped_examples.append(message)


def _iter_jsonl(path: Path, text_field: str, on_bad_line: str, stats: ReadStats) -> Iterator[str]:
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # as utf-8-sig reads it
                raw = raw[len(codecs.BOM_UTF8):]
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(decode_utf8(raw, stats))
            except json.JSONDecodeError as e:
                _bad_line(stats, on_bad_line, where, f"malformed JSON ({_json_problem(e)})")
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
            surrogate = _LONE_SURROGATE.search(value) if b"\\u" in raw else None
            if surrogate is not None:  # only a \uXXXX escape can put one in the text
                _bad_line(stats, on_bad_line, where, f"field {text_field!r} holds a lone surrogate "
                          f"\\u{ord(surrogate.group()):04x}, not valid Unicode (a \\uXXXX "
                          "escape that is not half of a surrogate pair)")
                continue
            yield value


def _json_problem(error: json.JSONDecodeError) -> str:
    """``Expecting value at column 7``: the decoder's message and where on the line."""
    message = error.msg if error.msg.endswith(" at") else f"{error.msg} at"
    return f"{message} column {error.colno}"


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


def _is_text_type(arrow_type) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):  # e.g. a pandas categorical of strings
        arrow_type = arrow_type.value_type
    is_string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or is_string_view(arrow_type))


def _iter_parquet(path: Path, column: str, on_bad_line: str, stats: ReadStats) -> Iterator[str]:
    """The strings of ``column``; a column of another type is refused, a null row is a bad
    line (an error, or skipped and counted)."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's own error types; the message says what is wrong
        raise UserError(f"{path} is not a readable Parquet file: {error}") from error
    schema = parquet.schema_arrow
    names = schema.names
    if column not in names:
        raise UserError(
            f"parquet file {path} has no column {column!r}; columns: {names} (choose one with "
            "--text-field)"
        )
    arrow_type = schema.field(names.index(column)).type
    if not _is_text_type(arrow_type):
        raise UserError(
            f"parquet file {path}: column {column!r} is of type {arrow_type}, not text; the "
            "text column must be of type string or large_string (choose another with "
            f"--text-field; columns: {names})"
        )
    row = 0
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        values = batch.column(0)
        if values.null_count == 0:
            row += len(values)
            yield from values.to_pylist()
            continue
        for value in values.to_pylist():
            row += 1
            if value is None:
                _bad_line(stats, on_bad_line, f"{path}: row {row}", f"column {column!r} is null",
                          rule="each row must hold a string in the text column")
                continue
            yield value


class DocumentStream(Iterator[str]):
    """The documents `iter_documents` streams, with the ``files`` they come from and the
    ``stats`` reading counts into (so a consumer can say what was read and skipped)."""

    def __init__(self, files: list[Path], stats: ReadStats, documents: Iterator[str]) -> None:
        self.files = files
        self.stats = stats
        self._documents = documents

    def __iter__(self) -> DocumentStream:
        return self

    def __next__(self) -> str:
        return next(self._documents)

    def close(self) -> None:
        """Stop reading (closes the file being read)."""
        self._documents.close()


def iter_documents(
    files: list[Path],
    *,
    text_field: str = "text",
    on_bad_line: str = "error",
    text_separator: str = "",
    stats: ReadStats,
) -> DocumentStream:
    """Stream documents: a JSONL line or Parquet row is one; a text file is one, or, with
    ``text_separator`` (e.g. ``"\\n\\n"``), each piece between separators is one."""
    if on_bad_line not in ("error", "skip"):
        raise UserError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
    files = list(files)
    return DocumentStream(files, stats, _documents(files, text_field, on_bad_line,
                                                   text_separator, stats))


def _documents(files: list[Path], text_field: str, on_bad_line: str, text_separator: str,
               stats: ReadStats) -> Iterator[str]:
    for path in files:
        kind = input_kind(path)
        if kind == "jsonl":
            documents: Iterator[str] = _iter_jsonl(path, text_field, on_bad_line, stats)
        elif kind == "parquet":
            documents = _iter_parquet(path, text_field, on_bad_line, stats)
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
