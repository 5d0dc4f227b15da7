"""A table of training runs for scaling fits: load and validate a results CSV, write one atomically.

Required columns: ``params`` (N), ``tokens`` (D), ``flops`` (C) and ``loss`` (final loss). Optional
numeric columns (``budget``, ``total_params``, ``non_embedding_params``, ``flops_actual``, ...)
are kept; ``run_dir`` points at a run directory whose ``metrics.jsonl`` holds the loss curve
(used by Chinchilla approach 1 and the L(C) envelope).
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densetrain.errors import UserError

REQUIRED_COLUMNS = ("params", "tokens", "flops", "loss")
POSITIVE_OPTIONAL_COLUMNS = ("budget", "total_params", "non_embedding_params", "flops_actual")


@dataclass(kw_only=True)
class ResultsTable:
    """Runs as parallel arrays. ``rows[i]`` holds every column of run i as text."""

    params: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray
    rows: list[dict[str, str]] = field(default_factory=list)
    source: str = "<memory>"

    def __len__(self) -> int:
        return int(self.params.shape[0])

    def column(self, name: str) -> np.ndarray:
        """A numeric optional column as floats; ``ValueError`` naming the column if absent."""
        if not self.rows or name not in self.rows[0]:
            raise UserError(f"{self.source}: column {name!r} is missing")
        return np.array([_parse_number(r[name], name, i, self.source) for i, r in
                         enumerate(self.rows)])

    def has_column(self, name: str) -> bool:
        """Whether every row has column ``name``."""
        return bool(self.rows) and all(name in r and r[name] != "" for r in self.rows)

    def subset(self, index: np.ndarray) -> ResultsTable:
        """A table of the rows at ``index`` (used by the bootstrap; repeats allowed)."""
        index = np.asarray(index, dtype=int)
        return ResultsTable(
            params=self.params[index], tokens=self.tokens[index], flops=self.flops[index],
            loss=self.loss[index], rows=[self.rows[i] for i in index] if self.rows else [],
            source=self.source,
        )


def _parse_number(text: str, column: str, row_index: int, source: str) -> float:
    line = row_index + 2  # the header is line 1
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(
            f"{source}: line {line}, column {column!r}: {text!r} is not a number"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(
            f"{source}: line {line}, column {column!r}: must be a finite number > 0, got {text!r}"
        )
    return value


def table_from_rows(rows: Sequence[dict[str, object]], *, source: str = "<memory>") -> ResultsTable:
    """Validate ``rows`` (dicts with at least the required columns) and build a table."""
    if not rows:
        raise UserError(f"{source}: no runs (the table is empty)")
    text_rows = [{str(k): "" if v is None else str(v) for k, v in r.items()} for r in rows]
    missing = [c for c in REQUIRED_COLUMNS if c not in text_rows[0]]
    if missing:
        raise UserError(
            f"{source}: missing column(s) {missing}; required: {list(REQUIRED_COLUMNS)}, "
            f"found: {list(text_rows[0])}"
        )
    values: dict[str, list[float]] = {c: [] for c in REQUIRED_COLUMNS}
    for i, row in enumerate(text_rows):
        for column in REQUIRED_COLUMNS:
            values[column].append(_parse_number(row.get(column, ""), column, i, source))
        for column in POSITIVE_OPTIONAL_COLUMNS:
            if row.get(column, "") != "":
                _parse_number(row[column], column, i, source)
    return ResultsTable(
        params=np.array(values["params"]), tokens=np.array(values["tokens"]),
        flops=np.array(values["flops"]), loss=np.array(values["loss"]),
        rows=text_rows, source=source,
    )


def load_results_csv(path: str | os.PathLike) -> ResultsTable:
    """Read and validate a results CSV; errors name the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"results file {str(path)!r} does not exist")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None:
            raise UserError(
                f"{path}: empty file (expected a header with {list(REQUIRED_COLUMNS)})"
            )
        missing = [c for c in REQUIRED_COLUMNS if c not in reader.fieldnames]
        if missing:
            raise UserError(
                f"{path}: missing column(s) {missing}; required: {list(REQUIRED_COLUMNS)}, "
                f"found: {reader.fieldnames}"
            )
        rows = list(reader)
    return table_from_rows(rows, source=str(path))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_results_csv(
    path: str | os.PathLike, rows: Iterable[dict[str, object]], columns: Sequence[str]
) -> None:
    """Write ``rows`` with ``columns`` (in that order) to ``path`` atomically."""
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _format_cell(v) for k, v in row.items()})
    atomic_write_text(path, buffer.getvalue())


def _format_cell(value: object) -> object:
    if isinstance(value, float | np.floating):
        return repr(float(value))
    if isinstance(value, np.integer):
        return int(value)
    return value


def load_loss_curve(run_dir: str | os.PathLike, *, field_name: str = "loss") -> np.ndarray:
    """(tokens, loss) pairs from ``run_dir/metrics.jsonl`` as an array of shape [points, 2].

    Lines without ``field_name`` (e.g. validation-only lines) are skipped; a line that is not
    JSON raises ``ValueError`` naming the file and line.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"loss curve {str(path)!r} does not exist")
    points: list[tuple[float, float]] = []
    with path.open() as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}: line {line_no} is not JSON ({err.msg})") from None
            if record.get(field_name) is None or record.get("tokens") is None:
                continue
            tokens, loss = float(record["tokens"]), float(record[field_name])
            if tokens > 0 and math.isfinite(loss) and loss > 0:
                points.append((tokens, loss))
    if len(points) < 2:
        raise UserError(f"{path}: fewer than 2 logged points with 'tokens' and {field_name!r}")
    return np.array(sorted(points))
