"""Start-up: wall seconds of the CLI commands that need no torch, and the time to the first
training step of the default run.

    python benchmarks/bench_startup.py [--runs 5] [--skip-train]

Each command runs as a fresh process, ``--runs`` times after one warm-up; the table gives the
median and min-max wall seconds and whether torch was imported. The time to the first step is
measured on ``densetrain train --training.steps=1`` with the default job (the corpus already
prepared in the cache by the warm-up run; no checkpoint or sample): the seconds from the
process start to the moment its first step line is printed, split into the seconds before the
step (imports, the allocator restart, config, data, model build, peak probe) and the step
itself as the run's metrics record it. The process wall time, which also holds the final
validation, the loss plot and the summary, is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_plan_cli import time_cli  # the same fresh-process timing (benchmarks/ is on the path)

COMMANDS = {
    "densetrain --help": ["--help"],
    "densetrain model-info llama3-8b": ["model-info", "llama3-8b"],
    "densetrain presets": ["presets"],
    "densetrain plan (llama3-70b, 1,024 H100)": [
        "plan", "--model", "llama3-70b", "--devices", "1024", "--seq-len", "8192",
        "--global-batch", "1024", "--cluster", "h100", "--top", "3"],
}
def time_first_step(runs: int) -> list[dict]:
    """Seconds from the process start to the end of the first step of a one-step default run
    (when its step line is printed), the first step itself, and the process wall time, ``runs``
    times (after one warm-up run that also prepares the default corpus if the cache lacks it).
    The process goes on after the step (the final validation, the loss plot, the summary), so
    its wall time is not the time to the first step."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs + 1):
            run_dir = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-m", "densetrain", "train", "--training.steps=1",
                   "--checkpoint.enabled=false", "--eval.interval=1000", "--eval.sample_tokens=0",
                   "--logging.progress=false", f"--logging.run_dir={run_dir}"]
            start = time.perf_counter()
            first_step_done = None
            with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) as proc:
                for line in proc.stderr:
                    if first_step_done is None and line.startswith("step 1/"):
                        first_step_done = time.perf_counter() - start
            wall = time.perf_counter() - start
            if proc.returncode or first_step_done is None:
                raise SystemExit(f"the default run failed (exit {proc.returncode}) or printed no "
                                 f"step line: {' '.join(cmd)}")
            metrics = [json.loads(line) for line in
                       (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            step_s = next(m["elapsed_s"] for m in metrics if m.get("step") == 1)
            if i:
                rows.append({"wall_s": wall, "to_first_step_s": first_step_done,
                             "first_step_s": step_s})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args()
    print("| command | wall s, median (min-max) | torch imported |")
    print("|---|---:|---|")
    for name, cmd in COMMANDS.items():
        got = time_cli(cmd, args.runs, check=False)
        print(f"| `{name}` | {got['median']:.2f} ({got['min']:.2f}-{got['max']:.2f}) | "
              f"{got['torch']} |", flush=True)
    if args.skip_train:
        return 0
    rows = time_first_step(max(1, args.runs // 2))
    walls = [r["wall_s"] for r in rows]
    to_step = [r["to_first_step_s"] for r in rows]
    steps = [r["first_step_s"] for r in rows]
    to_step_s, step_s = statistics.median(to_step), statistics.median(steps)
    print(f"\ndefault run, one step: the first step ends {to_step_s:.1f} s after the process "
          f"starts (min {min(to_step):.1f}, max {max(to_step):.1f}); the step itself "
          f"{step_s:.2f} s, so {to_step_s - step_s:.1f} s come before it; process wall "
          f"{statistics.median(walls):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
