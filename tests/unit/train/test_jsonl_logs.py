"""The run directory's JSON-lines logs after a write cut short: a torn last line is left out by
readers and dropped by the next process before it appends; an earlier bad line is an error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from densetrain.train import MetricsWriter, read_metrics
from densetrain.train.fault_record import FaultRecord, append_history, read_history
from densetrain.train.goodput import GoodputLedger, read_ledger
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


def _three_faults(run_dir: Path) -> None:
    for spike in (10, 20, 30):
        append_history(run_dir, _rollback(spike, spike - 2))


def _three_metrics(run_dir: Path) -> None:
    writer = MetricsWriter(run_dir)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 1.0})
    writer.close()


def _three_ledger_lines(run_dir: Path) -> None:
    ledger = GoodputLedger(run_dir, write=True, started=time.time())
    for step in (1, 2, 3):
        ledger.mark(ledger.step_bucket(step))
        ledger.flush(step)


@pytest.mark.parametrize("write, read, name, what", [
    (_three_faults, read_history, "faults.jsonl", "fault event"),
    (_three_metrics, read_metrics, "metrics.jsonl", "metrics record"),
    (_three_ledger_lines, read_ledger, "goodput.jsonl", "goodput ledger line"),
])
def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path, write, read, name, what):
    write(tmp_path)
    path = tmp_path / name
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:9]  # damaged, not torn: whole lines follow it
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{name}:2: not a {what} \("):
        read(tmp_path)


def test_a_record_that_is_not_an_object_is_named(tmp_path):
    _three_faults(tmp_path)
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
