"""Whole-process time of ``densetrain plan`` (start-up, imports and search included).

    python benchmarks/bench_plan_cli.py [--runs 5]

Runs each request as a fresh process, ``--runs`` times after one warm-up, and prints the median
and the min-max wall seconds, the search time the report states, and whether torch was imported.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

REQUESTS = [
    ("llama3-8b", 64, 4096, 1024),
    ("llama3-70b", 1024, 8192, 1024),
    ("llama3-405b", 8192, 8192, 2048),
    ("llama3-405b", 16384, 8192, 2048),
]
_PROBE = ("import runpy, sys; sys.argv = ['densetrain'] + sys.argv[1:]\n"
          "try:\n    runpy.run_module('densetrain', run_name='__main__')\n"
          "except SystemExit:\n    pass\n"
          "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n")


def time_cli(args: list[str], runs: int, *, check: bool = True) -> dict:
    """Wall seconds (median, min, max) of ``runs`` fresh ``densetrain ARGS`` processes after
    one warm-up, whether torch was imported, and the last run's stdout."""
    walls, out = [], None
    for i in range(runs + 1):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True,
                             text=True, check=check)
        if i:
            walls.append(time.perf_counter() - start)
    return {"median": statistics.median(walls), "min": min(walls), "max": max(walls),
            "torch": "torch imported: True" in out.stderr, "stdout": out.stdout}


def time_request(model: str, devices: int, seq: int, batch: int, runs: int) -> dict:
    """Wall seconds of ``runs`` fresh ``densetrain plan`` processes (after one warm-up)."""
    args = ["plan", "--model", model, "--devices", str(devices), "--seq-len", str(seq),
            "--global-batch", str(batch), "--cluster", "h100", "--top", "3"]
    got = time_cli(args, runs)
    search = re.search(r"searched in ([0-9.]+) s", got["stdout"])
    return {**got, "search_s": float(search.group(1)) if search else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("| model | devices | wall s, median (min-max) | search s | torch imported |")
    print("|---|---:|---:|---:|---|")
    for model, devices, seq, batch in REQUESTS:
        got = time_request(model, devices, seq, batch, args.runs)
        print(f"| {model} | {devices:,} | {got['median']:.2f} ({got['min']:.2f}-{got['max']:.2f})"
              f" | {got['search_s']:.2f} | {got['torch']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
