"""`FaultRecord`: the checkpointed record of a run's faults, and its history file.

The record (the entry ``faults`` of the state tree) holds the run's total of skipped
non-finite steps, its rollbacks and the data ranges they skipped; ``<run_dir>/faults.jsonl``
holds one line per event as it happens, so a rollback after the newest checkpoint is not
forgotten on resume.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from densetrain.train.jsonl import drop_torn_tail, read_json_lines

HISTORY_FILE = "faults.jsonl"


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
        all): a rollback after the newest checkpoint is in the history only."""
        events: list[Any] = [read_history(run_dir, drop_torn=True) if rank() == 0 else None]
        if dist_on():
            dist.broadcast_object_list(events, src=0)
        for event in events[0]:
            if event.get("event") == "rollback":
                self.add_rollback(int(event["spike_step"]), int(event["to_step"]))
                self.add_skip(int(event["skip"][0]), int(event["skip"][1]))


def read_history(run_dir: str | Path, *, drop_torn: bool = False) -> list[dict[str, Any]]:
    """The events of ``<run_dir>/faults.jsonl`` (empty when absent); a torn last line is left
    out (and, with ``drop_torn``, cut from the file: rank 0 on resume, before it appends); a bad
    line before it names itself."""
    path = Path(run_dir) / HISTORY_FILE
    if not path.is_file():
        return []
    events, torn_at = read_json_lines(path, "fault event")
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
