"""Parallel layouts on CPU: throughput, communication volume per step, pipeline bubble.

    .venv/bin/python benchmarks/bench_parallel.py [--steps 6] [--json out.json]

1. tokens/s of DP 2 (DDP) and FSDP 2 against one process (2 threads) on the same global batch.
2. Collective payload per rank per step in units of Ψ (parameter count), against the ZeRO paper's
   volumes (Rajbhandari et al. 2020 §7: 2Ψ for DP and ZeRO-1/2, 3Ψ for ZeRO-3). An all-reduce of
   n elements counts 2n (reduce-scatter + all-gather), an all-gather n (its output), a
   reduce-scatter n (its input).
3. Pipeline bubble: PP 2 (GPipe) step time T(m) for m = 1, 2, 4, 8 microbatches of a fixed
   size; the model T(m) = (m + p − 1)·c (Narayanan et al. 2021 §2.2) gives c from the slope
   and the measured bubble (p − 1)·c / (m·c) from the intercept, compared with (p − 1)/m.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from densetrain.models.config import ModelConfig
from densetrain.models.loss import cross_entropy_loss
from densetrain.models.transformer import Transformer
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.mesh import ParallelDims
from densetrain.parallel.parallelize import build_optimizer, init_weights, parallelize
from densetrain.testing import run_distributed

SEQ, GLOBAL_BATCH, SEED = 128, 8, 0


def bench_model_config() -> ModelConfig:
    """A small LLaMA-shaped model (about 6.3M parameters)."""
    return ModelConfig(vocab_size=4096, dim=256, num_layers=4, num_heads=8, ffn_dim=688,
                       max_seq_len=SEQ)


def _batch(step: int, batch: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, 4096, (batch, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-4)


class _CommCounter:
    """Counts collective payload elements by wrapping torch.distributed's Python entry points
    (FSDP2 and the ZeRO-1/2 optimizer call them; DDP's C++ reducer is counted by a comm hook)."""

    NAMES = {"all_reduce": 2, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1,
             "all_gather_single": 1, "reduce_scatter_single": 1}

    def __init__(self) -> None:
        self.elements = 0
        self._saved = {}

    def __enter__(self):
        for name, factor in self.NAMES.items():
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(*args, _orig=original, _name=name, _factor=factor, **kwargs):
                # all_reduce(tensor), all_gather_*(output, input), reduce_scatter_*(output, input)
                position = 1 if _name.startswith("reduce_scatter") else 0
                tensor = args[position] if len(args) > position else list(kwargs.values())[position]
                self.elements += _factor * tensor.numel()
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _ddp_counting_hook(counter: _CommCounter):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        # allreduce_hook calls torch.distributed.all_reduce, which the counter wraps.
        return allreduce_hook(state, bucket)

    return hook


def _train(rank: int, world: int, layout: dict, steps: int) -> dict:
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, world)
    pmesh = dims.build_mesh("cpu")
    model = parallelize(Transformer(bench_model_config()), pmesh, cfg)
    init_weights(model, SEED)
    opt = build_optimizer(model, pmesh, cfg, _adamw)
    counter = _CommCounter()
    if hasattr(model, "register_comm_hook"):
        model.register_comm_hook(dist.group.WORLD, _ddp_counting_hook(counter))
    local = dims.local_batch_size(GLOBAL_BATCH)
    times = []
    for step in range(steps):
        tokens, targets = _batch(step)
        start_row = pmesh.dp_rank * local
        tokens, targets = tokens[start_row:start_row + local], targets[start_row:start_row + local]
        counter.elements = 0
        start = time.perf_counter()
        with counter:
            cross_entropy_loss(model(tokens), targets).loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]), "comm_elements": counter.elements}


def _single_process(steps: int) -> float:
    torch.set_num_threads(2)
    model = Transformer(bench_model_config())
    model.init_weights(seed=SEED)
    opt = _adamw(model.parameters())
    times = []
    for step in range(steps):
        tokens, targets = _batch(step)
        start = time.perf_counter()
        cross_entropy_loss(model(tokens), targets).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _pipeline_times(rank: int, world: int, microbatch_counts: list[int], steps: int) -> dict:
    from densetrain.parallel.pipeline import build_pipeline

    out = {}
    for m in microbatch_counts:
        cfg = ParallelConfig(pp=2, dp_shard=1, pp_schedule="gpipe", pp_microbatches=m)
        dims = ParallelDims.from_config(cfg, world)
        pmesh = dims.build_mesh("cpu")
        pipe = build_pipeline(
            lambda: Transformer(bench_model_config()), pmesh, cfg,
            lambda logits, t: cross_entropy_loss(logits, t).loss,
            init_seed=SEED, device=torch.device("cpu"),
        )
        times = []
        for step in range(steps):
            tokens, targets = _batch(step, batch=2 * m)  # microbatch size 2, fixed
            dist.barrier()
            start = time.perf_counter()
            pipe.step(tokens, targets)
            times.append(time.perf_counter() - start)
        out[m] = statistics.median(times[1:])
    return out


def main() -> None:
    """Run the three measurements and print (and optionally save) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    psi = sum(p.numel() for p in Transformer(bench_model_config()).parameters())
    tokens_per_step = GLOBAL_BATCH * SEQ
    results: dict = {"params": psi}
    single_before = _single_process(args.steps)
    runs = {}
    for name, layout in {
        "ddp2": dict(dp_replicate=2, dp_shard=1),
        "zero1_2": dict(dp_shard=2, zero_stage=1),
        "zero2_2": dict(dp_shard=2, zero_stage=2),
        "fsdp2": dict(dp_shard=2, zero_stage=3),
    }.items():
        runs[name] = run_distributed(_train, 2, layout, args.steps)[0]
        print(name, runs[name], flush=True)
    # the machine is shared: take the single-process median before and after the ranks ran
    single = min(single_before, _single_process(args.steps))
    results["single_tokens_per_s"] = tokens_per_step / single
    for name, rank0 in runs.items():
        results[name] = {
            "tokens_per_s": tokens_per_step / rank0["step_s"],
            "vs_single": single / rank0["step_s"],
            "comm_per_step_in_psi": rank0["comm_elements"] / psi,
        }
    counts = [1, 2, 4, 8]
    pp = run_distributed(_pipeline_times, 2, counts, args.steps)[0]
    slope, intercept = _fit_line(counts, [pp[m] for m in counts])
    results["pp2_gpipe"] = {
        "step_s": pp,
        "per_microbatch_s": slope,
        "bubble_measured": {m: intercept / (slope * m) for m in counts},
        "bubble_theory": {m: 1 / m for m in counts},
    }
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


if __name__ == "__main__":
    main()
