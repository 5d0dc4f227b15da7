"""The planner's predictions against measured steps on this machine.

    python benchmarks/bench_planner_vs_measured.py [--rounds 3] [--steps 8]
                                                   [--calibration this-machine.toml]

Each round calibrates the machine (``densetrain plan --calibrate``, unless a calibration file
is given) and then trains a small model for a few steps through ``densetrain train`` in several
layouts (one process; two gloo ranks with FSDP, DDP, tensor and pipeline parallelism), one
thread per rank. It prints a Markdown table of predicted and measured step time (per round the
median over the steps after the first two; the table gives the median over the rounds with
their min-max) and of the largest peak RSS over the ranks, with the error of each.
The fixed memory of a training process (Python, torch, the data pipeline, the
allocator's arenas, autograd's engine) is measured once by the same run of a one-layer model of
width 16, less what the planner counts for that model, and is given to the planner as its
workspace. Collectives over gloo run on the cores that compute, so the predictions take no
data-parallel overlap (``PlanSettings.dp_overlap=False``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from densetrain.models.config import ModelConfig
from densetrain.planner import Layout, PlanSettings, evaluate_layout, get_cluster, load_cluster_file

MODEL = dict(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=704,
             max_seq_len=128)
SEQ, BATCH, MICRO = 128, 8, 4
LAYOUTS = {
    "1 process": Layout(micro_batch_size=MICRO),
    "2 ranks FSDP (dp_shard 2)": Layout(dp_shard=2, zero_stage=3, micro_batch_size=MICRO),
    "2 ranks DDP (dp_replicate 2)": Layout(dp_replicate=2, micro_batch_size=MICRO),
    "2 ranks TP 2 + SP": Layout(tp=2, sequence_parallel=True, micro_batch_size=MICRO),
    "2 ranks PP 2 (1F1B)": Layout(pp=2, pp_schedule="1f1b", micro_batch_size=MICRO // 2),
}


def _overrides(cache: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"--training.steps={steps}", "--schedule.warmup_steps=1", "--training.device=cpu",
            "--checkpoint.enabled=false", "--eval.interval=0", "--eval.sample_tokens=0",
            "--logging.plot=false", "--logging.progress=false", "--logging.tensorboard=false",
            "--logging.log_interval=1", "--data.default_max_files=40",
            f"--data.default_vocab_size={MODEL['vocab_size']}", f"--data.cache_dir={cache}",
            f"--logging.run_dir={run_dir}", "--training.dtype=fp32"]


TINY = {**MODEL, "dim": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "ffn_dim": 32}


def measure(layout: Layout, work: Path, name: str, steps: int, model: dict = MODEL) -> dict:
    """Median step seconds (and spread) and the largest peak RSS over the ranks of a short
    run (the planner predicts the busiest device)."""
    from densetrain.planner.emit import emit_config

    config = emit_config(work / f"{name}.toml", ModelConfig(**model), layout, seq_len=SEQ,
                         global_batch=BATCH)
    run_dir = work / f"run-{name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rss_dir = work / f"rss-{name}"
    rss_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={layout.devices}", str(Path(__file__).with_name("rank_peak_rss.py")),
           str(rss_dir), "train", str(config), *_overrides(work / "cache", run_dir, steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{name}: training failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "tokens_per_s" in r][2:]
    seconds = [BATCH * SEQ / r["tokens_per_s"] for r in records]
    peaks = [float(p.read_text()) for p in sorted(rss_dir.glob("rank*.rss"))]
    if len(peaks) != layout.devices:
        raise RuntimeError(f"{name}: {len(peaks)} of {layout.devices} ranks reported a peak RSS")
    return {"step_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "peak_bytes": max(peaks)}


def fixed_process_bytes(work: Path, cluster, settings: PlanSettings) -> float:
    """Peak RSS of a one-process run of the ``TINY`` model less the planner's count for it.

    A first run prepares the data cache that every later run reads, so that the measured run,
    like the layouts', does not hold the tokenizer's training and the corpus scan."""
    measure(LAYOUTS["1 process"], work, "prepare", 3, model=TINY)
    got = measure(LAYOUTS["1 process"], work, "fixed", 4, model=TINY)
    counted = evaluate_layout(ModelConfig(**TINY), SEQ, BATCH, LAYOUTS["1 process"], cluster,
                              settings)["mem_total"]
    return got["peak_bytes"] - counted


def _calibrate(work: Path, round_index: int):
    path = work / f"this-machine-{round_index}.toml"
    subprocess.run([sys.executable, "-m", "densetrain", "plan", "--calibrate", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    return get_cluster("this-machine", load_cluster_file(path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=None,
                        help="cluster file from plan --calibrate (default: calibrate each round)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (calibrate, every layout); medians over the rounds")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="densetrain-bench-plan-"))
    fixed_cluster = (get_cluster("this-machine", load_cluster_file(args.calibration))
                     if args.calibration else None)
    settings = PlanSettings(precision="fp32", activation_bytes=4, workspace_gb=0.0,
                            usable_memory_fraction=1.0, dp_overlap=False)
    rows: dict[str, list[tuple[dict, dict]]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        cluster = fixed_cluster or _calibrate(work, r)
        if r == 0:
            fixed = fixed_process_bytes(work, cluster, settings)
            settings = dataclasses.replace(settings, workspace_gb=fixed / 1e9)
            print(f"fixed memory of a training process: {fixed / 1e6:.0f} MB", flush=True)
        for i, (name, layout) in enumerate(LAYOUTS.items()):
            got = measure(layout, work, f"r{r}-layout{i}", args.steps)
            row = evaluate_layout(ModelConfig(**MODEL), SEQ, BATCH, layout, cluster, settings)
            rows[name].append((row, got))
            print(f"round {r + 1}: {name}: predicted {row['step_s']:.3f} s, measured "
                  f"{got['step_s']:.3f} s", flush=True)
    print("| layout | predicted step s | measured step s (rounds' min-max) | time error "
          "(rounds' min-max) | predicted MB | measured MB | memory error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = statistics.median
    for name, pairs in rows.items():
        pred = med(p["step_s"] for p, _ in pairs)
        meas = [g["step_s"] for _, g in pairs]
        errs = [p["step_s"] / g["step_s"] - 1 for p, g in pairs]
        mem_p = med(p["mem_total"] for p, _ in pairs)
        mem_m = med(g["peak_bytes"] for _, g in pairs)
        print(f"| {name} | {pred:.3f} | {med(meas):.3f} ({min(meas):.3f}-{max(meas):.3f}) | "
              f"{med(errs):+.0%} ({min(errs):+.0%} to {max(errs):+.0%}) | {mem_p / 1e6:.0f} | "
              f"{mem_m / 1e6:.0f} | {mem_p / mem_m - 1:+.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
