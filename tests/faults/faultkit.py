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


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def env_of(pid: int) -> dict[str, str]:
    """The environment of process ``pid``."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def logged_steps(run_dir: Path) -> int:
    """The last step written to ``metrics.jsonl`` so far (0 when none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()
             if line.strip().endswith("}")]
    return steps[-1] if steps else 0


def mount_tmpfs(path: Path, size_bytes: int) -> bool:
    """Mount a tmpfs of ``size_bytes`` at ``path``; False where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                             str(path)], capture_output=True)
    return result.returncode == 0


def unmount(path: Path) -> None:
    """Unmount a `mount_tmpfs` mount."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
