"""`FaultRecord`: the checkpointed record of a run's faults, and its history file.

The record (the entry ``faults`` of the state tree) holds the run's total of skipped
non-finite steps, its rollbacks and the data ranges they skipped; ``<run_dir>/faults.jsonl``
holds one line per event as it happens, so a rollback after the newest checkpoint is not
forgotten on resume. Every event is checked as it is read (`check_event`): a bad one is an error
naming ``faults.jsonl:LINE`` and the field, not a crash on every restart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from densetrain.errors import UserError
from densetrain.train.jsonl import drop_torn_tail, read_json_lines
from densetrain.values import is_int_at_least

HISTORY_FILE = "faults.jsonl"
EVENT_KINDS = ("rollback", "sdc")
"""The ``event`` of each line of the history (`append_history`'s callers in faults.py)."""


def dist_on() -> bool:
    """True inside an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if dist_on() else 0


class FaultRecord:
    """Stateful record of the run's faults: skipped non-finite steps, rollbacks and the skipped
    data ranges (global sequence positions). Saved in every checkpoint as one JSON string, the
    same on every rank."""

    def __init__(self) -> None:
        self.skipped_steps = 0
        self.skip_ranges: list[tuple[int, int]] = []
        self.rollbacks: list[dict[str, int]] = []
        """``{"spike_step", "to_step"}`` of each rollback."""

    def state_dict(self) -> dict[str, Any]:
        """``{"record": json}``."""
        return {"record": json.dumps({"skipped_steps": self.skipped_steps,
                                      "skip_ranges": self.skip_ranges,
                                      "rollbacks": self.rollbacks})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`."""
        record = json.loads(state["record"])
        self.skipped_steps = int(record["skipped_steps"])
        self.skip_ranges = [(int(a), int(b)) for a, b in record["skip_ranges"]]
        self.rollbacks = [{k: int(v) for k, v in r.items()} for r in record["rollbacks"]]

    def add_skip(self, start: int, end: int) -> None:
        """Record one more skipped range."""
        if (start, end) not in self.skip_ranges:
            self.skip_ranges.append((start, end))

    def add_rollback(self, spike_step: int, to_step: int) -> None:
        """Record one rollback."""
        entry = {"spike_step": spike_step, "to_step": to_step}
        if entry not in self.rollbacks:
            self.rollbacks.append(entry)

    def merge_history(self, run_dir: Path) -> None:
        """Add the rollbacks and ranges of ``<run_dir>/faults.jsonl`` (read on rank 0, sent to
        all): a rollback after the newest checkpoint is in the history only. A bad line is a
        ``UserError`` on every rank (none is left waiting for rank 0)."""
        events: list[Any] = [None]
        if rank() == 0:
            try:
                events[0] = read_history(run_dir, drop_torn=True)
            except UserError as err:
                events[0] = str(err)
        if dist_on():
            dist.broadcast_object_list(events, src=0)
        if isinstance(events[0], str):
            raise UserError(events[0])
        for event in events[0]:
            if event["event"] == "rollback":  # checked by read_history
                self.add_rollback(event["spike_step"], event["to_step"])
                self.add_skip(event["skip"][0], event["skip"][1])


def _step_field(event: dict[str, Any], name: str) -> int:
    """``event[name]``, which must be a step number (an integer >= 0)."""
    if name not in event:
        raise UserError(f"a {event['event']} event needs the field {name!r}, which is missing")
    value = event[name]
    if not is_int_at_least(value, 0):
        raise UserError(f"field {name!r} is {value!r}; it must be a step number (an integer "
                        ">= 0)")
    return value


def check_event(event: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the field when ``event`` is not a fault event: ``event`` one
    of `EVENT_KINDS`; a rollback's ``spike_step`` and ``to_step`` step numbers, ``to_step``
    before ``spike_step``, ``skip`` the pair ``[start, end]`` of sequence positions it skipped,
    ``0 <= start <= end``."""
    kind = event.get("event")
    if kind not in EVENT_KINDS:
        raise UserError(f"field 'event' is {kind!r}; a fault event is one of "
                        f"{', '.join(EVENT_KINDS)}")
    if kind != "rollback":
        return
    spike_step, to_step = _step_field(event, "spike_step"), _step_field(event, "to_step")
    if to_step >= spike_step:
        raise UserError(f"field 'to_step' is {to_step}, not before 'spike_step' {spike_step}: "
                        "a rollback goes back to an earlier step")
    skip = event.get("skip")
    if not (isinstance(skip, list) and len(skip) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in skip)
            and 0 <= skip[0] <= skip[1]):
        raise UserError(f"field 'skip' is {skip!r}; it must be the skipped sequence positions "
                        "[start, end], integers with 0 <= start <= end")


def read_history(run_dir: str | Path, *, drop_torn: bool = False) -> list[dict[str, Any]]:
    """The events of ``<run_dir>/faults.jsonl`` (empty when absent), each checked
    (`check_event`); a torn last line is left out (and, with ``drop_torn``, cut from the file:
    rank 0 on resume, before it appends); any other bad line is a ``UserError`` naming
    ``faults.jsonl:LINE`` and the field."""
    path = Path(run_dir) / HISTORY_FILE
    if not path.is_file():
        return []
    try:
        events, torn_at = read_json_lines(path, "fault event", check_event)
    except ValueError as err:
        raise UserError(f"{err}. {HISTORY_FILE} is the run's record of its rollbacks, read on "
                        "every resume: repair or remove that line") from err
    if drop_torn and torn_at is not None:
        drop_torn_tail(path, torn_at)
    return events


def append_history(run_dir: Path, event: dict[str, Any]) -> None:
    """Rank 0 appends ``event`` (with the time) to ``<run_dir>/faults.jsonl``."""
    if rank() != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / HISTORY_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
