"""Checkpoint cost on one process: stall per save (synchronous vs DCP async), and manifest
verification time against load time.

A stack of linear layers of ``--params`` parameters with AdamW state (three fp32 copies: weights
and two moments) is saved ``--saves`` times through `AsyncCheckpointer`, once with
``async_save=False`` and once with ``async_save=True``, with ``--step-s`` seconds of matmul work
between saves standing for training steps. The stall is the time `save` blocks the caller
(for async: staging to CPU memory plus waiting for the previous save, if it is not done yet);
the background time of an async save is reported beside it. Verification is
`verify_checkpoint` (SHA-256 of every file) against `load_checkpoint(verify=False)` of the same
checkpoint. Usage: ``python benchmarks/bench_checkpoint.py [--params 25e6] [--saves 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from densetrain.checkpoint import (
    ModelState,
    TrainerCounters,
    load_checkpoint,
    verify_checkpoint,
)
from densetrain.checkpoint.async_save import AsyncCheckpointer
from densetrain.optim.interface import StandardOptimizer


def _model(params: float) -> torch.nn.Module:
    width = 1024
    layers = max(1, int(params // (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": ModelState(model), "optim": StandardOptimizer(model, optimizer),
            "trainer": TrainerCounters(step=step)}


def _work(seconds: float) -> None:
    a = torch.randn(512, 512)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _run(mode_async: bool, model, optimizer, saves: int, step_s: float, root: Path) -> dict:
    writer = AsyncCheckpointer(root, config_toml="x = 1\n", keep_last=2, async_save=mode_async)
    background = []
    for index in range(saves):
        _work(step_s)
        writer.save(index + 1, _state(model, optimizer, index + 1))
        began = time.perf_counter()
        if mode_async and index == saves - 1:
            writer.wait()
            background.append(time.perf_counter() - began)
    writer.close()
    return {"stall_s": statistics.median(writer.stall_seconds),
            "stalls": writer.stall_seconds, "final_wait_s": background[-1] if background else 0}


def main() -> None:
    """Run the benchmark and print a Markdown summary."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=2.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = _model(args.params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        sync = _run(False, model, optimizer, args.saves, args.step_s, Path(tmp) / "sync")
        asyn = _run(True, model, optimizer, args.saves, args.step_s, Path(tmp) / "async")
        path = Path(tmp) / "async" / f"step-{args.saves:08d}"
        size = sum(f.stat().st_size for f in path.iterdir())
        began = time.perf_counter()
        assert verify_checkpoint(path) == []
        verify_s = time.perf_counter() - began
        began = time.perf_counter()
        load_checkpoint(path, _state(model, optimizer, 0), verify=False)
        load_s = time.perf_counter() - began
    print(f"params {params / 1e6:.1f}M, checkpoint {size / 2**20:.0f} MiB, {args.saves} saves, "
          f"{args.step_s:g} s of work between saves, {torch.get_num_threads()} threads")
    print("| mode | median stall per save (s) | stalls (s) | final wait (s) |")
    print("|---|---|---|---|")
    for name, result in (("sync", sync), ("async", asyn)):
        stalls = ", ".join(f"{s:.2f}" for s in result["stalls"])
        print(f"| {name} | {result['stall_s']:.2f} | {stalls} | {result['final_wait_s']:.2f} |")
    print(f"verify (SHA-256 of every file): {verify_s:.2f} s ({size / verify_s / 1e9:.2f} GB/s); "
          f"load: {load_s:.2f} s; verify/load = {verify_s / load_s:.2f}")


if __name__ == "__main__":
    main()
