"""The planner's advice runs: its top layouts for a tiny model on 2, 4 and 8 CPU ranks, written
as job configs (``plan --emit-config``), each train two steps through ``densetrain train`` under
torchrun on gloo. Only the run's length, corpus size and output folder are given on the command
line; model, batch and layout come from the emitted file unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from densetrain.models.config import ModelConfig
from densetrain.planner import get_cluster, search
from densetrain.planner.emit import emit_config
from densetrain.planner.report import _signature

TINY_MODEL = dict(vocab_size=512, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  ffn_dim=128, max_seq_len=64)
SEQ_LEN, GLOBAL_BATCH = 32, 16


def run_overrides(cache: Path, run_dir: Path) -> list[str]:
    """What a short test run changes: length, corpus size, outputs (never model or layout)."""
    return ["--training.steps=2", "--schedule.warmup_steps=1", "--checkpoint.enabled=false",
            "--eval.interval=0", "--eval.sample_tokens=0", "--logging.plot=false",
            "--logging.progress=false", "--logging.tensorboard=false", "--training.device=cpu",
            "--logging.log_interval=1",
            "--data.default_max_files=40", "--data.default_vocab_size=512",
            f"--data.cache_dir={cache}", f"--logging.run_dir={run_dir}"]


def torchrun_train(config: Path, nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    """``densetrain train config`` on ``nproc`` gloo ranks under torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "densetrain", "train", str(config), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def top_distinct_layouts(devices: int, count: int):
    """The planner's ``count`` best layouts that differ in more than the DP split."""
    result = search(ModelConfig(**TINY_MODEL), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                    devices=devices, cluster=get_cluster("h100"))
    seen, chosen = set(), []
    for i in range(len(result)):
        sig = _signature(result, i)
        if sig not in seen:
            seen.add(sig)
            chosen.append(result.layout(i))
        if len(chosen) == count:
            break
    return result, chosen


def _check_runs(devices: int, count: int, tmp_path: Path) -> None:
    result, layouts = top_distinct_layouts(devices, count)
    cache = tmp_path / "cache"
    for k, layout in enumerate(layouts):
        config = emit_config(tmp_path / f"plan-{k}.toml", result.cfg, layout, seq_len=SEQ_LEN,
                             global_batch=GLOBAL_BATCH)
        run_dir = tmp_path / f"run-{k}"
        done = torchrun_train(config, devices, run_overrides(cache, run_dir))
        assert done.returncode == 0, (layout.describe(), done.stderr[-4000:])
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
                 .splitlines() if '"loss"' in line]
        assert steps == [1, 2], layout.describe()


def test_top_layouts_on_two_ranks_train(tmp_path):
    _check_runs(2, 2, tmp_path)


@pytest.mark.slow
def test_top_layouts_on_four_ranks_train(tmp_path):
    _check_runs(4, 4, tmp_path)


@pytest.mark.slow
def test_top_layouts_on_eight_ranks_train(tmp_path):
    _check_runs(8, 4, tmp_path)


def test_cli_emit_config_trains_unchanged(tmp_path):
    model_file = tmp_path / "tiny.toml"
    model_file.write_text("[model]\n" + "".join(f"{k} = {v}\n" for k, v in TINY_MODEL.items()))
    out = tmp_path / "out.toml"
    plan = subprocess.run(
        [sys.executable, "-m", "densetrain", "plan", "--model", str(model_file), "--seq-len",
         str(SEQ_LEN), "--global-batch", str(GLOBAL_BATCH), "--devices", "2", "--emit-config",
         str(out)], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    text = out.read_text()
    assert "[parallel]" in text and f"seq_len = {SEQ_LEN}" in text
    run_dir = tmp_path / "run"
    done = torchrun_train(out, 2, run_overrides(tmp_path / "cache", run_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    assert (run_dir / "metrics.jsonl").is_file()
