"""Helpers of the fault-injection suite: a tiny job, loss curves, real faults on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = [
    "--model.dim=64", "--model.embed_dim=64", "--model.head_dim=16", "--model.num_layers=2",
    "--model.num_heads=4", "--model.num_kv_heads=2", "--model.ffn_dim=128",
    "--data.seq_len=32", "--data.default_max_files=40", "--data.default_vocab_size=512",
    "--data.default_val_fraction=0.2", "--training.global_batch_size=8",
    "--training.micro_batch_size=4", "--training.steps=6", "--schedule.warmup_steps=2",
    "--optim.lr=3e-3", "--eval.interval=0", "--eval.sample_tokens=0",
    "--checkpoint.interval=2", "--checkpoint.keep_last=0", "--logging.log_interval=1",
    "--logging.progress=false", "--logging.tensorboard=false", "--logging.plot=false",
]


def overrides(cache: str, run_dir: Path, *extra: str) -> list[str]:
    """The tiny job's overrides writing into ``run_dir``."""
    return TINY + [f"--data.cache_dir={cache}", f"--logging.run_dir={run_dir}", *extra]


def job(cache: str, run_dir: Path, *extra: str):
    """A validated tiny `JobConfig`."""
    from densetrain.config import load_job_config

    return load_job_config(None, overrides(cache, run_dir, *extra))


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of every logged step of a run."""
    from densetrain.train import read_metrics

    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


def history(run_dir: Path) -> list[dict]:
    """The run's history events."""
    path = run_dir / "run_history.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli(args: list[str], **kwargs) -> subprocess.Popen:
    """``python -m densetrain train ARGS`` in a child process (stdout/stderr captured)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "densetrain", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def largest_shard(checkpoint: Path) -> Path:
    """The biggest DCP data file of a checkpoint."""
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of ``path`` in place (the middle one by default)."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2 if offset is None else offset)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def truncate_half(path: Path) -> None:
    """Cut ``path`` to half its size."""
    os.truncate(path, path.stat().st_size // 2)
