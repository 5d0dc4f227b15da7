"""The prepared GPU benchmark (`benchmarks/gpu.py`) runs end to end on the CPU with ``--smoke``:
the script that a lent GPU has minutes for must not fail on its own Python. Each size and dtype
runs in its own child, as on the GPU; a freshly initialised model (std 0.02) predicts nearly
uniformly, so its first losses are ln(vocab) — the reference the rows are checked against."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOKE_VOCAB = 512  # gpu.model_config(..., smoke=True)


def test_gpu_benchmark_smoke_runs_every_size_it_is_given(tmp_path):
    dtypes = "bf16,float8" if importlib.util.find_spec("torchao") else "bf16"
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--sizes", "1b,8b",
         "--dtypes", dtypes, "--seq", "32", "--steps", "1", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and "timed out" not in result.stdout, result.stdout
    rows = json.loads(out.read_text())
    # every size in bf16 before any float8 run: a session cut short keeps the bf16 rows
    assert [(r["size"], r["dtype"]) for r in rows] == [
        (size, dtype) for dtype in dtypes.split(",") for size in ("1b", "8b")]
    for row in rows:
        assert abs(row["loss"] - math.log(SMOKE_VOCAB)) < 0.1, row
        assert row["tokens_per_s"] > 0 and row["time_to_first_step_s"] > 0
        # the 8B shape takes full activation checkpointing, as on the GPU
        assert row["activation_checkpointing"] == {"1b": "none", "8b": "full"}[row["size"]]
