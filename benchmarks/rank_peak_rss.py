"""Run ``python -m densetrain ARGS`` as a child and write its peak RSS to OUT_DIR/rank<R>.rss.

    torchrun ... benchmarks/rank_peak_rss.py OUT_DIR train job.toml ...

A launcher for benchmarks that need every rank's peak memory (the trainer logs rank 0's):
``RUSAGE_CHILDREN`` holds the largest resident set of the waited-for child, which Linux keeps
across the trainer's own re-exec (``training.host_allocator``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path


def main() -> int:
    out_dir, args = Path(sys.argv[1]), sys.argv[2:]
    code = subprocess.run([sys.executable, "-m", "densetrain", *args], check=False).returncode
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    tmp = out_dir / f".rank{os.environ.get('RANK', '0')}.rss.tmp"
    tmp.write_text(str(peak))
    os.replace(tmp, out_dir / f"rank{os.environ.get('RANK', '0')}.rss")
    return code


if __name__ == "__main__":
    sys.exit(main())
