"""Goodput ledger: every second of a run's wall time, across its processes, in one bucket.

Gemini (Gemini Team, 2023) raised goodput from 85% to 97%, and Llama 3 (Dubey et al., 2024,
§3.3.4) reports over 90% effective training time; both need an account of where the time went.
The loop marks each phase of an iteration (`GoodputLedger.mark`); the time between two marks
goes to the bucket of the phase it ends, so the buckets of one process add up to its time from
`train()` to the end of the loop. Rank 0 appends one JSON line per iteration to
``<run_dir>/goodput.jsonl`` (``process``, ``start``, ``end``, ``step``, ``buckets``), so a killed
process loses at most its last iteration. Across processes the gap between one process's last
line and the next one's first is ``down`` (dead time: a crash, the restart, the interpreter's own
start-up before `train()`).

Buckets: ``startup`` (build, resume), ``data`` (reading and preparing the batch), ``productive``
(steps at a step number the run had not reached before), ``recomputed`` (steps redone after a
rollback or a restart from an older checkpoint), ``checks`` (the fault checks, rollbacks
included), ``evaluation``, ``callbacks`` (logging, checkpoint saves: checkpoint stalls show
here), ``down``. A line also counts ``storage_retries`` when requests to an object store
(checkpoints under ``s3://``) were retried during it: timeouts, dropped connections, 5xx and
throttling, which the storage library retries with backoff (`checkpoint.objstore`). Every
``faults.straggler_interval`` steps a line also holds ``collective_wait_s``, the seconds the
ranks (on average) waited in the step's collectives for slower ranks over the steps measured
since the last such line, and ``stragglers``, the ranks named slow then (`train.stragglers`);
that time is inside the ``productive``/``recomputed`` buckets, not a bucket of its own.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from densetrain.errors import UserError, UserFileNotFoundError
from densetrain.storage_url import take_retries
from densetrain.train.jsonl import drop_torn_tail, read_json_lines
from densetrain.values import is_int_at_least

LEDGER_FILE = "goodput.jsonl"
BUCKETS = ("productive", "recomputed", "startup", "data", "checks", "evaluation", "callbacks",
           "down")


def read_ledger(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of ``<run_dir>/goodput.jsonl``: ``ValueError`` naming a bad line (`check_line`),
    except a torn last one (its process was killed, or the disk filled, while writing it), which
    is left out: the ledger then ends at that process's previous iteration. ``UserError`` when
    ``run_dir`` is not a directory or holds no ledger."""
    directory = Path(run_dir)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} is a file; give the run's directory (its "
                        f"logging.run_dir), which holds {LEDGER_FILE}")
    if not directory.is_dir():
        raise UserError(f"run directory {directory} does not exist")
    return _parse_ledger(directory / LEDGER_FILE)[0]


def _parse_ledger(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """(The ledger's whole lines, the byte offset of a torn last line or None)."""
    if not path.is_file():
        raise UserFileNotFoundError(f"{path} does not exist: not a densetrain run directory, or "
                                    "the run predates the goodput ledger")
    return read_json_lines(path, "goodput ledger line", check_line)


def _seconds(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def check_line(entry: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the field when ``entry`` is not a ledger line: ``process`` a
    string; ``start`` and ``end`` finite times, ``start <= end``; ``step`` an integer >= 0;
    ``buckets`` an object of `BUCKETS` names (``down`` is derived, never written) to finite
    seconds >= 0."""
    for name in ("process", "start", "end", "step", "buckets"):
        if name not in entry:
            raise UserError(f"the field {name!r} is missing")
    if not isinstance(entry["process"], str):
        raise UserError(f"field 'process' is {entry['process']!r}; it must be a string")
    start, end = _seconds(entry["start"]), _seconds(entry["end"])
    for name, value in (("start", start), ("end", end)):
        if value is None:
            raise UserError(f"field {name!r} is {entry[name]!r}; it must be a finite time "
                            "in seconds")
    if end < start:
        raise UserError(f"field 'end' {end} is before 'start' {start}")
    step = entry["step"]
    if not is_int_at_least(step, 0):
        raise UserError(f"field 'step' is {step!r}; it must be an integer >= 0")
    buckets = entry["buckets"]
    if not isinstance(buckets, dict):
        raise UserError(f"field 'buckets' is {buckets!r}; it must be an object of seconds "
                        "per bucket")
    written = [b for b in BUCKETS if b != "down"]
    for bucket, value in buckets.items():
        if bucket not in written:
            raise UserError(f"field 'buckets.{bucket}': no such bucket; the buckets are "
                            f"{', '.join(written)}")
        seconds = _seconds(value)
        if seconds is None or seconds < 0:
            raise UserError(f"field 'buckets.{bucket}' is {value!r}; seconds must be a finite "
                            "number >= 0")
    if "collective_wait_s" in entry:
        wait = _seconds(entry["collective_wait_s"])
        if wait is None or wait < 0:
            raise UserError(f"field 'collective_wait_s' is {entry['collective_wait_s']!r}; it "
                            "must be a finite number of seconds >= 0")
    stragglers = entry.get("stragglers", [])
    if not (isinstance(stragglers, list) and all(
            isinstance(s, dict) and is_int_at_least(s.get("rank"), 0)
            and is_int_at_least(s.get("since_step"), 0) and _seconds(s.get("factor")) is not None
            for s in stragglers)):
        raise UserError(f"field 'stragglers' is {stragglers!r}; it must be a list of objects "
                        "with an integer rank, a factor and an integer since_step")


def high_water_step(lines: list[dict[str, Any]]) -> int:
    """The highest step any process of the run reached."""
    return max((int(e.get("step", 0)) for e in lines), default=0)


class GoodputLedger:
    """This process's ledger (rank 0 writes; other ranks only count)."""

    def __init__(self, run_dir: Path, *, write: bool, started: float) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self.write = write
        self.process = f"{os.getpid()}-{started:.6f}"
        self.totals = dict.fromkeys(BUCKETS, 0.0)
        self._line: dict[str, float] = {}
        self._line_start = started
        self._last = started
        self.high_water = 0
        self.storage_retries = 0
        self.collective_wait_s = 0.0
        self._notes: dict[str, Any] = {}
        if write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                lines, torn_at = _parse_ledger(self.path)
                if torn_at is not None:  # cut off, or this process's lines would follow it
                    drop_torn_tail(self.path, torn_at)
                self.high_water = high_water_step(lines)

    def mark(self, bucket: str) -> None:
        """The time since the previous mark was spent on ``bucket``."""
        now = time.time()
        self._line[bucket] = self._line.get(bucket, 0.0) + now - self._last
        self.totals[bucket] += now - self._last
        self._last = now

    def step_bucket(self, step: int) -> str:
        """``productive`` for a step number never reached before, else ``recomputed``."""
        if step > self.high_water:
            self.high_water = step
            return "productive"
        return "recomputed"

    def flush(self, step: int) -> None:
        """Write the line of the time since the last flush (rank 0)."""
        retries = take_retries()
        self.storage_retries += retries
        if self.write and self._line:
            entry = {"process": self.process, "start": self._line_start, "end": self._last,
                     "step": step, "buckets": self._line}
            if retries:  # their time is in the bucket of the phase that waited on them
                entry["storage_retries"] = retries
            entry.update(self._notes)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        self._line, self._line_start, self._notes = {}, self._last, {}

    def note_waiting(self, seconds: float, stragglers: list[dict[str, Any]]) -> None:
        """Seconds the ranks waited in collectives (mean over ranks) since the last note, and
        the stragglers named now: fields of the next line."""
        self.collective_wait_s += seconds
        self._notes["collective_wait_s"] = self._notes.get("collective_wait_s", 0.0) + seconds
        if stragglers:
            self._notes["stragglers"] = stragglers

    def summary(self) -> dict[str, float]:
        """This process's seconds per bucket and its goodput (productive / accounted)."""
        total = sum(self.totals.values())
        return {**{f"goodput_{k}_s": v for k, v in self.totals.items() if k != "down"},
                "goodput_process": self.totals["productive"] / total if total else 0.0,
                "goodput_storage_retries": self.storage_retries,
                "goodput_collective_wait_s": self.collective_wait_s}


def ledger_totals(lines: list[dict[str, Any]]) -> tuple[dict[str, float], float]:
    """Seconds per bucket over the run's lines (``down`` = gaps between processes) and the
    wall time from the first line's start to the last line's end."""
    totals = dict.fromkeys(BUCKETS, 0.0)
    ordered = sorted(lines, key=lambda e: float(e["start"]))
    for entry in ordered:
        for bucket, seconds in entry["buckets"].items():
            totals[bucket] = totals.get(bucket, 0.0) + float(seconds)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after["process"] != before["process"]:
            totals["down"] += max(float(after["start"]) - float(before["end"]), 0.0)
    wall = float(ordered[-1]["end"]) - float(ordered[0]["start"]) if ordered else 0.0
    return totals, wall


def ledger_waiting(lines: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    """Seconds lost to waiting in collectives over the run's lines (mean over ranks), and each
    straggler episode once (rank, host, since_step, the largest factor, last step seen)."""
    wait = sum(float(e.get("collective_wait_s", 0.0)) for e in lines)
    episodes: dict[tuple[int, int], dict[str, Any]] = {}
    for entry in sorted(lines, key=lambda e: float(e["start"])):
        for s in entry.get("stragglers", []):
            key = (int(s["rank"]), int(s["since_step"]))
            seen = episodes.setdefault(key, {**s, "last_step": int(entry["step"])})
            seen["factor"] = max(float(seen["factor"]), float(s["factor"]))
            seen["last_step"] = int(entry["step"])
    return wait, list(episodes.values())
