"""What a run says while it trains, through the real CLI: a plain line per logged step when the
output is a pipe (no carriage-return redraws), the bar on a terminal (a pseudo-terminal), one
warning for an MFU above 100%, and a re-run of a finished run that says so and changes nothing.
The numbers in the lines are checked against the run's own ``metrics.jsonl``."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from densetrain.train import read_metrics

LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<total>\d+) \| loss (?P<loss>[\d.]+)"
    r"(?: \| val (?P<val>[\d.]+))? \| lr (?P<lr>[\d.e+-]+) \| (?P<tok>[\d,]+) tok/s"
    r" \| mfu (?P<mfu>[\d.]+)% \| grad (?P<grad>[\d.e+-]+) \| eta (?P<eta>\S+)$"
)


def _cli_args(make_job, tmp_path: Path, run: str, *extra: str) -> list[str]:
    from densetrain.testing import TINY_OVERRIDES

    cache = make_job().data.cache_dir
    return ["train", *TINY_OVERRIDES, f"--data.cache_dir={cache}",
            f"--logging.run_dir={tmp_path / run}", "--logging.plot=false", *extra]


def _densetrain(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-m", "densetrain", *args], env=env, timeout=300,
                          check=False, **kwargs)


@pytest.mark.parametrize("progress", ["true", "false"])
def test_piped_output_gets_one_plain_line_per_logged_step(make_job, tmp_path, progress) -> None:
    args = _cli_args(make_job, tmp_path, "piped", "--training.steps=6", "--eval.interval=3",
                     "--logging.log_interval=2", f"--logging.progress={progress}",
                     "--checkpoint.enabled=false", "--eval.sample_tokens=0")
    done = _densetrain(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stderr and "\r" not in done.stdout
    lines = [LINE.match(ln) for ln in done.stderr.splitlines() if ln.startswith("step ")]
    assert all(lines), done.stderr
    records = {r["step"]: r for r in read_metrics(tmp_path / "piped")}
    # every 2 steps, and at the evaluations (3, 6)
    assert [int(m["step"]) for m in lines] == [2, 3, 4, 6] == sorted(records)
    for match in lines:
        record = records[int(match["step"])]
        assert match["total"] == "6"
        assert float(match["loss"]) == pytest.approx(record["loss"], abs=5e-5)
        assert float(match["lr"]) == pytest.approx(record["lr"], rel=5e-3)
        assert float(match["grad"]) == pytest.approx(record["grad_norm"], rel=5e-3)
        assert float(match["mfu"]) == pytest.approx(100 * record["mfu"], abs=0.051)
        assert int(match["tok"].replace(",", "")) == pytest.approx(record["tokens_per_s"],
                                                                    abs=0.51)
    # the latest validation loss, from the first evaluation on
    assert lines[0]["val"] is None
    assert [float(m["val"]) for m in lines[1:]] == pytest.approx(
        [records[3]["val_loss"], records[3]["val_loss"], records[6]["val_loss"]], abs=5e-5)
    assert lines[-1]["eta"] == "0s"
    # stdout holds the run's ending only: steps, losses, wall time and where the files are
    summary = json.loads((tmp_path / "piped" / "summary.json").read_text())
    ending = done.stdout.splitlines()
    assert ending[0].startswith("done: 6 steps in ")
    assert f"train loss {summary['final_loss']:.4f}" in ending[0]
    assert f"val loss {summary['final_val_loss']:.4f}" in ending[0]
    assert ending[1:] == [
        "  checkpoint none (checkpoint.enabled=false)",
        f"  metrics    {tmp_path / 'piped' / 'metrics.jsonl'}",
        "  plot       none (logging.plot=false)",
        f"  summary    {tmp_path / 'piped' / 'summary.json'}"]


def test_a_terminal_gets_the_progress_bar_with_the_validation_loss(make_job, tmp_path) -> None:
    args = _cli_args(make_job, tmp_path, "tty", "--training.steps=4", "--eval.interval=2",
                     "--logging.log_interval=1", "--logging.progress=true",
                     "--checkpoint.enabled=false", "--eval.sample_tokens=0")
    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "densetrain", *args], stdout=child_fd,
                            stderr=child_fd, stdin=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    assert proc.wait(timeout=300) == 0
    shown = b"".join(chunks).decode("utf-8", "replace")
    assert "\r" in shown and "train:" in shown  # the bar redraws in place
    assert not re.search(r"^step \d+/4 \|", shown, re.MULTILINE)  # no plain lines
    val = read_metrics(tmp_path / "tty")[-1]["val_loss"]
    assert f"val={val:.4f}" in shown


def test_mfu_above_100_percent_is_warned_once(make_job, tmp_path) -> None:
    # A pinned peak far below this CPU's rate makes MFU read far above 100%.
    args = _cli_args(make_job, tmp_path, "lowpeak", "--training.steps=3", "--eval.interval=0",
                     "--logging.peak_tflops=1e-6", "--checkpoint.enabled=false",
                     "--eval.sample_tokens=0")
    done = _densetrain(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [ln for ln in done.stderr.splitlines() if ln.startswith("warning: MFU")]
    assert len(warnings) == 1, done.stderr
    assert "pinned by logging.peak_tflops" in warnings[0]
    assert "--logging.peak_tflops" in warnings[0]
    summary = json.loads((tmp_path / "lowpeak" / "summary.json").read_text())
    assert summary["mfu"] > 1 and "--logging.peak_tflops" in summary["mfu_warning"]


def _run_files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_rerunning_a_finished_run_says_so_and_changes_nothing(make_job, tmp_path,
                                                              capsys) -> None:
    from densetrain.cli.main import main

    args = _cli_args(make_job, tmp_path, "done", "--training.steps=4", "--eval.interval=2",
                     "--checkpoint.interval=2", "--eval.sample_tokens=0")
    assert main(args) == 0
    run_dir = tmp_path / "done"
    assert capsys.readouterr().out.startswith("done: 4 steps in ")
    first = json.loads((run_dir / "summary.json").read_text())
    before = _run_files(run_dir)
    assert main(args) == 0
    again = capsys.readouterr()
    assert again.out == ""
    said = [ln for ln in again.err.splitlines() if "already finished" in ln]
    assert len(said) == 1 and "step 4 of training.steps=4" in said[0], again.err
    assert _run_files(run_dir) == before  # summary, metrics, checkpoints: byte for byte
    stored = json.loads((run_dir / "summary.json").read_text())
    assert stored["final_loss"] == first["final_loss"] and stored["final_loss"] > 0
    # A longer run continues from the final checkpoint and writes its own summary.
    assert main([*args, "--training.steps=6"]) == 0
    assert capsys.readouterr().out.startswith("done: 6 steps in ")
    longer = json.loads((run_dir / "summary.json").read_text())
    assert longer["steps"] == 6 and longer["resumed_from"].endswith("step-00000004")
    assert longer["final_loss"] == read_metrics(run_dir)[-1]["loss"]
