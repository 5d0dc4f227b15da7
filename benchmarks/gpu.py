"""Training-step tokens/s and MFU of LLaMA-style models of about 1B, 3B and 8B on one CUDA GPU.

One run on an H100/H200-class GPU gives the figures in well under 8 minutes: each size runs in
its own child process (clean memory, an OOM is reported and the next size still runs) with
bf16 autocast, per-block ``torch.compile``, activation checkpointing where the size needs it,
the chunked output projection + loss, AdamW and clipping through the trainer's `train_step`.

* 1B: the Llama 3.2 1B shape (16 layers, width 2048, 32 heads / 8 kv, SwiGLU 8192, tied).
* 3B: the Llama 3.2 3B shape (28 layers, width 3072, 24 heads / 8 kv, SwiGLU 8192, tied).
* 8B: the Llama 3 8B preset (32 layers, width 4096, 32 heads / 8 kv, SwiGLU 14336).

Weights: fp32 master weights and AdamW states (16 bytes/parameter) when they fit in about 55%
of the GPU's memory, else bf16 weights and states (8 bytes/parameter, reported as
``weights=bf16``): 8B with fp32 master weights needs 128 GB before activations.
MFU = tokens/s × `flops_per_token_palm` ÷ the datasheet bf16 dense peak
(`densetrain.train.metrics.ACCELERATOR_PEAK_TFLOPS`), for float8 runs too (the convention of
float8 training reports), with model TFLOP/s beside it.

Each row also gives the time to the first step (build, compile and the first step) and the
planner's memory prediction for the same layout (`densetrain.planner.evaluate_layout` on the
cluster entry of the GPU, e.g. ``h200-141gb``) against ``torch.cuda.max_memory_allocated``, and
its step-time prediction against the measured median step (bf16 rows: the GPU rows of
docs/planner.md's predicted-vs-measured table).

Usage: ``python benchmarks/gpu.py [--sizes 1b,3b,8b] [--dtypes bf16,float8] [--seq 4096]
[--steps 8] [--json FILE]``; ``--smoke`` runs shrunken models on CPU to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

# (layers, dim, heads, kv_heads, head_dim, ffn, tied, micro-batch sequences at seq 4096, AC)
SIZES = {
    "1b": dict(num_layers=16, dim=2048, num_heads=32, num_kv_heads=8, head_dim=64,
               ffn_dim=8192, tie_embeddings=True, micro_batch=4, ac="none"),
    "3b": dict(num_layers=28, dim=3072, num_heads=24, num_kv_heads=8, head_dim=128,
               ffn_dim=8192, tie_embeddings=True, micro_batch=2, ac="selective"),
    "8b": dict(num_layers=32, dim=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn_dim=14336, tie_embeddings=False, micro_batch=2, ac="full"),
}


def model_config(size: str, seq: int, smoke: bool):
    """The `ModelConfig` of a benchmark size (shrunk to a few layers of width 64 for --smoke)."""
    from densetrain.models.presets import get_preset

    spec = dict(SIZES[size])
    for key in ("micro_batch", "ac"):
        spec.pop(key)
    if smoke:
        spec.update(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128)
    spec["embed_dim"] = spec["dim"]
    cfg = get_preset("llama3-8b").replace(max_seq_len=max(seq, 8192), **spec)
    return cfg.replace(vocab_size=512) if smoke else cfg


@torch.no_grad()
def _fast_init(model: torch.nn.Module, std: float) -> None:
    # The seeded init_weights draws on the CPU for bit-identical layouts; throughput does not
    # depend on the values, so draw on the device and keep the benchmark short.
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std)


def planner_prediction(cfg, seq: int, micro: int, ac: str, device_name: str
                       ) -> tuple[float, float] | None:
    """The planner's (peak memory GiB, step seconds) for one GPU running this benchmark's
    layout (fp32 master weights, bf16 activations), or None when no cluster entry matches."""
    from densetrain.planner import Layout, PlanSettings, evaluate_layout, get_cluster

    name = next((key for gpu, key in (("H200", "h200-141gb"), ("H100", "h100-80gb"),
                                      ("A100", "a100-80gb")) if gpu in device_name), None)
    if name is None:
        return None
    layout = Layout(micro_batch_size=micro, activation_checkpointing=ac)
    settings = PlanSettings(precision="fp32", activation_bytes=2)
    row = evaluate_layout(cfg, seq, micro, layout, get_cluster(name), settings)
    return row["mem_total"] / 2**30, float(row["step_s"])


def run_child(size: str, seq: int, steps: int, warmup: int, smoke: bool,
              dtype: str = "bf16") -> dict:
    """Build, compile and time one size in ``dtype`` (bf16 or float8); return its figures."""
    build_start = time.perf_counter()
    from densetrain.data import Batch
    from densetrain.models import Transformer, flops_per_token_palm, param_counts
    from densetrain.optim.interface import StandardOptimizer
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims
    from densetrain.parallel.model import SpmdModel, model_loss_fn
    from densetrain.parallel.parallelize import parallelize
    from densetrain.train.device import autocast_factory, synchronize
    from densetrain.train.metrics import device_peak_flops
    from densetrain.train.step import train_step

    device = torch.device("cpu" if smoke else "cuda")
    cfg = model_config(size, seq, smoke)
    micro, ac = SIZES[size]["micro_batch"], SIZES[size]["ac"]
    params = param_counts(cfg).total
    memory = torch.cuda.get_device_properties(device).total_memory if not smoke else 1 << 40
    master_fp32 = params * 16 < 0.55 * memory
    with torch.device("meta"):
        model = Transformer(cfg)
    if dtype == "float8":
        from densetrain.parallel.float8 import convert_blocks_to_float8

        convert_blocks_to_float8(model, "tensorwise")
    pcfg = ParallelConfig(activation_checkpointing=ac)
    model = parallelize(model, ParallelDims.from_config(pcfg, 1).build_mesh("cpu"), pcfg,
                        compile=not smoke)
    model.to_empty(device=device)
    _fast_init(model, cfg.init_std)
    if not master_fp32:
        model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=not smoke
    )
    autocast = autocast_factory(device, "bf16")
    laid_out = SpmdModel(module=model, loss_fn=model_loss_fn(4096))
    training_optimizer = StandardOptimizer(model, optimizer)

    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for i in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (micro, seq + 1), device=device, generator=gen)
        batch = Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:])
        synchronize(device)
        start = time.perf_counter()
        out = train_step(laid_out, training_optimizer, batch, micro_batch_size=micro,
                         grad_clip=1.0, autocast=autocast, nan_policy="stop", step=i + 1)
        synchronize(device)
        if i == 0:
            first_step_s = time.perf_counter() - build_start
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = micro * seq / step_s
    flops_per_token = flops_per_token_palm(cfg, seq)
    peak, source = device_peak_flops(device, "bf16")
    device_name = "cpu" if smoke else torch.cuda.get_device_name(device)
    predicted = (planner_prediction(cfg, seq, micro, ac, device_name)
                 if master_fp32 and not smoke else None)
    return {
        "size": size, "dtype": dtype, "params_b": params / 1e9, "seq": seq,
        "micro_batch": micro, "time_to_first_step_s": first_step_s,
        "planner_mem_gib": predicted[0] if predicted else None,
        # the planner models bf16 compute; a float8 step has no prediction
        "planner_step_s": predicted[1] if predicted and dtype == "bf16" else None,
        "activation_checkpointing": ac, "weights": "fp32-master" if master_fp32 else "bf16",
        "median_step_s": step_s, "tokens_per_s": tokens_per_s,
        "tflops_per_s": tokens_per_s * flops_per_token / 1e12,
        "mfu": tokens_per_s * flops_per_token / peak, "peak": source,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if not smoke else 0.0,
        "loss": float(out.loss),
        "device": device_name,
    }


def main() -> None:
    """Run each size in a child process and print a table (and JSON lines)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1b,3b,8b")
    parser.add_argument("--dtypes", default="bf16", help="bf16 and/or float8 (comma-separated)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per size")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks only)")
    parser.add_argument("--child", default="")
    parser.add_argument("--child-dtype", default="bf16")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.seq, args.steps, args.warmup, args.smoke,
                                   args.child_dtype)))
        return
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (or --smoke to check it on CPU)")
    rows: list[dict] = []
    if args.json:  # rewritten after every row: a run killed at its time limit keeps them
        _write_json(args.json, rows)
    # dtype-major: every size in the first dtype (bf16, whose MFU the targets are about) before
    # any float8 run, so a session cut short loses the float8 rows first
    runs = [(size, dtype) for dtype in args.dtypes.split(",") for size in args.sizes.split(",")]
    for size, dtype in runs:
        cmd = [sys.executable, __file__, "--child", size, "--seq", str(args.seq),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--child-dtype", dtype]
        cmd += ["--smoke"] if args.smoke else []
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env=env, check=False)
        except subprocess.TimeoutExpired:
            print(f"{size} {dtype}: timed out after {args.timeout:.0f} s", flush=True)
            continue
        if out.returncode != 0:
            print(f"{size} {dtype}: failed\n{out.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            _write_json(args.json, rows)
    print("\n| size | dtype | params | weights | AC | seq × micro | tokens/s | TFLOP/s | MFU | "
          "peak mem | planner mem | step s | planner step s | first step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        planned = r["planner_mem_gib"]
        planned = "-" if planned is None else (
            f"{planned:.1f} GiB ({planned / max(r['peak_mem_gib'], 1e-9) - 1:+.0%})")
        step = r.get("planner_step_s")
        step = "-" if step is None else f"{step:.3f} ({step / r['median_step_s'] - 1:+.0%})"
        print(f"| {r['size']} | {r['dtype']} | {r['params_b']:.2f}B | {r['weights']} | "
              f"{r['activation_checkpointing']} | {r['seq']} × {r['micro_batch']} | "
              f"{r['tokens_per_s']:,.0f} | {r['tflops_per_s']:.0f} | {100 * r['mfu']:.1f}% | "
              f"{r['peak_mem_gib']:.1f} GiB | {planned} | {r['median_step_s']:.3f} | {step} | "
              f"{r['time_to_first_step_s']:.0f} s |")


def _write_json(path: str, rows: list[dict]) -> None:
    # a temporary name, then a rename: a kill mid-write never leaves a half-written file
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
