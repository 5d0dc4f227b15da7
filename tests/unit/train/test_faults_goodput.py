"""Goodput ledger: a run with a rollback, a kill and a resume accounts every second of its wall
time to one bucket; `densetrain goodput` prints the table and writes the timeline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from densetrain.cli.main import main
from densetrain.train import Callback, train
from densetrain.train.goodput import GoodputLedger, ledger_totals, read_ledger

JOB = ("--training.steps=14", "--checkpoint.interval=4", "--checkpoint.keep_last=0",
       "--eval.interval=7", "--eval.sample_tokens=0", "--logging.plot=false",
       "--faults.spike_warmup_steps=6", "--faults.spike_min_history=4",
       "--faults.spike_window=8", "--faults.rollback_min_steps=2",
       "--faults.rollback_skip_batches=3")


class _SpikeThenKill(Callback):
    """Scales the output projection after step 9 (a spike at 10, rolled back to 8), then
    raises after the step 10 taken again."""

    def __init__(self) -> None:
        self.spiked = False

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == 9 and not self.spiked:
            self.spiked = True
            with torch.no_grad():
                parts.model.module.output.weight.mul_(30.0)
        if progress.step == 10 and parts.fault_record.rollbacks:
            raise KeyboardInterrupt("killed after step 10")


@pytest.mark.slow
def test_ledger_of_a_rollback_kill_and_resume_adds_up_to_wall_time(make_job, capsys) -> None:
    job = make_job(*JOB)
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[_SpikeThenKill()])
    time.sleep(1.0)  # the run is down
    summary = train(job)  # resumes from step 8 and redoes 9 and 10 once more
    lines = read_ledger(job.logging.run_dir)
    totals, wall = ledger_totals(lines)
    assert sum(totals.values()) == pytest.approx(wall, rel=1e-9)
    assert totals["down"] >= 1.0
    assert totals["recomputed"] > 0 and totals["productive"] > 0
    assert totals["startup"] > 0 and totals["evaluation"] > 0
    productive_lines = [e for e in lines if "productive" in e["buckets"]]
    assert sorted(e["step"] for e in productive_lines) == list(range(1, 15))  # each step once
    assert 0 < summary["goodput_process"] < 1
    assert main(["goodput", job.logging.run_dir]) == 0
    out = capsys.readouterr().out
    assert "recomputed" in out and "goodput (productive / wall)" in out
    assert (Path(job.logging.run_dir) / "goodput.png").is_file()


def test_goodput_command_names_a_missing_ledger(tmp_path, capsys) -> None:
    assert main(["goodput", str(tmp_path)]) == 2
    assert "goodput.jsonl does not exist" in capsys.readouterr().err


def test_two_processes_account_their_time_and_the_gap_between(tmp_path) -> None:
    for steps in ((1, 2), (2, 3)):  # the second process resumes from step 1: 2 is redone
        ledger = GoodputLedger(tmp_path, write=True, started=time.time())
        time.sleep(0.02)
        ledger.mark("startup")
        ledger.flush(steps[0] - 1)
        for step in steps:
            time.sleep(0.01)
            ledger.mark(ledger.step_bucket(step))
            ledger.flush(step)
        time.sleep(0.05)  # down: not marked, the process ends
    totals, wall = ledger_totals(read_ledger(tmp_path))
    assert sum(totals.values()) == pytest.approx(wall, rel=1e-9)
    assert totals["down"] >= 0.05
    lines = read_ledger(tmp_path)
    assert [(e["step"], *e["buckets"]) for e in lines[-2:]] == [(2, "recomputed"),
                                                                (3, "productive")]


def _process(run_dir: Path, steps: tuple[int, ...]) -> None:
    ledger = GoodputLedger(run_dir, write=True, started=time.time())
    ledger.mark("startup")
    ledger.flush(steps[0] - 1)
    for step in steps:
        ledger.mark(ledger.step_bucket(step))
        ledger.flush(step)


def test_a_torn_last_line_is_dropped_by_the_next_process_not_a_crash_loop(tmp_path, capsys):
    _process(tmp_path, (1, 2, 3))
    path = tmp_path / "goodput.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # killed while writing step 3's line
    assert [e["step"] for e in read_ledger(tmp_path)] == [0, 1, 2]  # the torn line left out
    _process(tmp_path, (3, 4))  # the restart: step 3 was never accounted, so it is productive
    assert "dropped a torn last line" in capsys.readouterr().err
    lines = read_ledger(tmp_path)
    assert [(e["step"], *e["buckets"]) for e in lines[-2:]] == [(3, "productive"),
                                                                (4, "productive")]
    assert main(["goodput", str(tmp_path)]) == 0
