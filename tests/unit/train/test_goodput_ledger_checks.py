"""`densetrain goodput` on a bad ledger: every line is checked (bucket names, seconds, times,
step) and a bad one is an error naming ``goodput.jsonl:LINE`` and the field, the last line
included; an empty ledger and a file given for the run directory are named as such."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from densetrain.cli.main import main
from densetrain.train.goodput import GoodputLedger, read_ledger


def _ledger(run_dir: Path, steps: int = 3) -> Path:
    """A real ledger of ``steps`` iterations written by `GoodputLedger`."""
    ledger = GoodputLedger(run_dir, write=True, started=time.time())
    ledger.mark("startup")
    ledger.flush(0)
    for step in range(1, steps + 1):
        ledger.mark(ledger.step_bucket(step))
        ledger.flush(step)
    return run_dir / "goodput.jsonl"


def _line(**changes) -> dict:
    line = {"process": "1-2.0", "start": 100.0, "end": 112.0, "step": 7,
            "buckets": {"productive": 10.0, "data": 2.0}}
    line.update(changes)
    return line


def _goodput(run_dir: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["goodput", str(run_dir), "--no-plot"])
    return code, capsys.readouterr().err


BAD_LINES = [
    (_line(buckets={"bogus_bucket": 5.0, "productive": -100.0}),
     "field 'buckets.bogus_bucket': no such bucket; the buckets are productive"),
    (_line(buckets={"productive": -100.0}), "field 'buckets.productive' is -100.0; seconds must"),
    (_line(buckets={"productive": float("nan")}), "field 'buckets.productive' is nan"),
    (_line(buckets={"productive": "10"}), "field 'buckets.productive' is '10'"),
    (_line(buckets={"down": 3.0}), "field 'buckets.down': no such bucket"),
    (_line(buckets=[1.0]), "field 'buckets' is [1.0]"),
    (_line(start=float("inf")), "field 'start' is inf; it must be a finite time"),
    (_line(end=90.0), "field 'end' 90.0 is before 'start' 100.0"),
    (_line(step=-1), "field 'step' is -1; it must be an integer >= 0"),
    (_line(step=True), "field 'step' is True"),
    (_line(process=3), "field 'process' is 3; it must be a string"),
    ({k: v for k, v in _line().items() if k != "buckets"}, "the field 'buckets' is missing"),
]


@pytest.mark.parametrize("bad, message", BAD_LINES)
@pytest.mark.parametrize("last", [True, False], ids=["last-line", "middle-line"])
def test_a_bad_ledger_line_is_an_error_naming_its_line_and_field(tmp_path, capsys, bad, message,
                                                                 last):
    path = _ledger(tmp_path)
    lines = path.read_text().splitlines()
    lines.insert(len(lines) if last else 2, json.dumps(bad))
    path.write_text("\n".join(lines) + "\n")
    number = len(lines) if last else 3
    code, err = _goodput(tmp_path, capsys)
    assert code == 2
    assert f"goodput.jsonl:{number}: not a goodput ledger line ({message}" in err
    assert "Traceback" not in err and "goodput (productive / wall)" not in err


def test_a_good_ledger_still_prints_the_table(tmp_path, capsys):
    _ledger(tmp_path)
    assert main(["goodput", str(tmp_path), "--no-plot"]) == 0
    assert "goodput (productive / wall):" in capsys.readouterr().out


def test_the_next_process_refuses_a_ledger_with_a_bad_last_line_rather_than_dropping_it(tmp_path):
    path = _ledger(tmp_path)
    with open(path, "a") as f:
        f.write(json.dumps(_line(buckets={"productive": -1.0})) + "\n")
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"goodput.jsonl:5: .*'buckets.productive' is -1.0"):
        GoodputLedger(tmp_path, write=True, started=time.time())
    assert path.read_bytes() == before  # not cut as if torn


@pytest.mark.parametrize("content", [b"", b"\n\n", b'{"process": "1-2.0", "sta'],
                         ids=["empty", "blank-lines", "only-a-torn-line"])
def test_a_ledger_without_entries_says_so(tmp_path, capsys, content):
    (tmp_path / "goodput.jsonl").write_bytes(content)
    code, err = _goodput(tmp_path, capsys)
    assert code == 2
    assert f"{tmp_path / 'goodput.jsonl'} holds no entries" in err
    assert "0.0 s of wall time" not in capsys.readouterr().out


def test_a_file_given_for_the_run_directory_is_named(tmp_path, capsys):
    _ledger(tmp_path)
    summary = tmp_path / "summary.json"
    summary.write_text("{}\n")
    code, err = _goodput(summary, capsys)
    assert code == 2
    assert f"{summary} is a file; give the run's directory" in err
    assert "summary.json/goodput.jsonl" not in err


def test_a_missing_run_directory_is_named(tmp_path, capsys):
    code, err = _goodput(tmp_path / "nope", capsys)
    assert code == 2 and f"run directory {tmp_path / 'nope'} does not exist" in err
    with pytest.raises(ValueError, match="does not exist"):
        read_ledger(tmp_path / "nope")
