"""Start-up: wall seconds of the CLI commands that need no torch, and the time to the first
training step of the default run.

    python benchmarks/bench_startup.py [--runs 5] [--skip-train]

Each command runs as a fresh process, ``--runs`` times after one warm-up; the table gives the
median and min-max wall seconds and whether torch was imported. The time to the first step is
the wall time of ``densetrain train --training.steps=1`` on the default job (the corpus already
prepared in the cache by the warm-up run; no checkpoint, evaluation or sample), split into the
seconds before the first step starts (imports, config, data, model build) and the step itself,
as the run's own metrics record them.
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
    """Wall seconds of a one-step default run, and its first step, ``runs`` times (after one
    warm-up run that also prepares the default corpus if the cache lacks it)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs + 1):
            run_dir = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-m", "densetrain", "train", "--training.steps=1",
                   "--checkpoint.enabled=false", "--eval.interval=1000", "--eval.sample_tokens=0",
                   "--logging.progress=false", f"--logging.run_dir={run_dir}"]
            start = time.perf_counter()
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - start
            metrics = [json.loads(line) for line in
                       (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            step_s = next(m["elapsed_s"] for m in metrics if m.get("step") == 1)
            if i:
                rows.append({"wall_s": wall, "first_step_s": step_s})
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
    steps = [r["first_step_s"] for r in rows]
    print(f"\ndefault run, one step: process wall {statistics.median(walls):.1f} s "
          f"(min {min(walls):.1f}, max {max(walls):.1f}); first step {statistics.median(steps):.2f}"
          f" s; start-up before it {statistics.median(walls) - statistics.median(steps):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
