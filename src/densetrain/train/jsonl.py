"""The run directory's append-only JSON-lines logs (``metrics.jsonl``, ``goodput.jsonl``,
``faults.jsonl``): reading them, and their torn last line.

Each log is appended one whole line per write. A process killed, or a disk filled, during a
write leaves the last line torn; nothing else can be half-written. So a bad *last* line is
expected after a crash and is left out (and dropped from the file by the next process that
appends, before it appends: otherwise its lines would bury the torn one between whole lines),
while a bad line before the last means the file was damaged and is an error naming
``file:line``. Only a line that is not JSON can be torn: a cut-short write of a JSON object is
never itself one, so a whole JSON line that is not a record of the log (a JSON list, a missing or
ill-typed field) is damage wherever it stands, the last line included.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from densetrain.errors import UserError


def read_json_lines(path: Path, what: str,
                    check: Callable[[dict[str, Any]], object] | None = None,
                    ) -> tuple[list[dict[str, Any]], int | None]:
    """(The whole records of ``path``, the byte offset where a torn last line starts or None).

    ``check(record)`` raises (``KeyError``, ``TypeError``, ``ValueError``) for a JSON object
    that is not a ``what`` record. A line that is not JSON, before the last, and a whole JSON
    line that is not a ``what`` record, anywhere, raise ``ValueError`` naming ``path:line`` and
    ``what``.
    """
    raw_lines = path.read_bytes().split(b"\n")
    records: list[dict[str, Any]] = []
    offset = 0
    for number, raw in enumerate(raw_lines, start=1):
        line_start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if not any(rest.strip() for rest in raw_lines[number:]):
                return records, line_start  # torn: its process stopped while writing it
            detail = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
            raise UserError(f"{path}:{number}: not a {what} ({detail})") from err
        try:  # a whole JSON line: never torn, so a wrong one is damage even when last
            if not isinstance(record, dict):
                raise TypeError(f"a JSON {type(record).__name__}, not an object")
            if check is not None:
                check(record)
        except (KeyError, TypeError, ValueError) as err:
            detail = f"no field {err}" if isinstance(err, KeyError) else str(err)
            raise UserError(f"{path}:{number}: not a {what} ({detail})") from err
        records.append(record)
    return records, None


def drop_torn_tail(path: Path, offset: int) -> None:
    """Cut ``path`` back to its first ``offset`` bytes (written to a temporary name, then
    renamed) and say so on stderr."""
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src:
        tmp.write_bytes(src.read(offset))
    os.replace(tmp, path)
    print(f"{path}: dropped a torn last line (its process stopped while writing it); the log "
          "goes on from the line before", file=sys.stderr, flush=True)
