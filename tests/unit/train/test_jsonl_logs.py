"""The run directory's JSON-lines logs after a write cut short: a torn last line is left out by
readers and dropped by the next process before it appends; an earlier bad line is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from densetrain.train.fault_record import FaultRecord, append_history, read_history
from densetrain.train.jsonl import read_json_lines


def _cut(path: Path, count: int) -> None:
    """Remove the last ``count`` bytes of ``path``: a write that stopped part-way."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - count])


def _rollback(spike: int, to: int) -> dict:
    return {"event": "rollback", "spike_step": spike, "to_step": to, "skip": [spike, spike + 2]}


def test_a_torn_fault_event_is_dropped_on_resume_and_the_earlier_ones_kept(tmp_path, capsys):
    append_history(tmp_path, _rollback(10, 8))
    append_history(tmp_path, _rollback(20, 16))
    _cut(tmp_path / "faults.jsonl", 15)
    record = FaultRecord()
    record.merge_history(tmp_path)  # the resume: before, this raised on every restart
    assert record.rollbacks == [{"spike_step": 10, "to_step": 8}]
    assert "dropped a torn last line" in capsys.readouterr().err
    append_history(tmp_path, _rollback(30, 28))
    assert [e["spike_step"] for e in read_history(tmp_path)] == [10, 30]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    for spike in (10, 20, 30):
        append_history(tmp_path, _rollback(spike, spike - 2))
    path = tmp_path / "faults.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = "[1, 2]"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"faults.jsonl:2: not a fault event \(a JSON list"):
        read_history(tmp_path)


@pytest.mark.parametrize("tail, torn", [(b"", False), (b"\n\n", False), (b'{"a": ', True),
                                         (b"\xff\xfe", True)])
def test_only_the_last_line_may_be_torn(tmp_path, tail, torn):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n' + tail)
    records, torn_at = read_json_lines(path, "record")
    assert records == [{"a": 1}, {"a": 2}]
    assert torn_at == (len(b'{"a": 1}\n{"a": 2}\n') if torn else None)
