"""fp32 CPU linears: MKL (``F.linear``) against oneDNN (`densetrain.models.linear`), per
reduction size and in the whole training step.

1. ``[tokens × K] @ [K × out]`` for K in ``--reductions``: both libraries alternating call by
   call; the speed ratio oneDNN/MKL per K (what ``onednn_reduction_limit`` is chosen from;
   the last column says which library densetrain's rule picks on this CPU).
2. The matmuls of ``bench_train``'s GPT-2-shaped training step (block forward, input and
   weight gradients, output head), MKL (``@``) against oneDNN in the operand layouts that
   `densetrain.models.linear` passes it, alternating call by call.
3. The densetrain training step (``--models``, ``bench_train``'s shapes) with its linears as they
   are, against the same step with the AVX2 rule (``ONEDNN_AVX2_MAX_REDUCTION``: what AVX2 CPUs
   get) and inside `aten_matmuls` (every linear on MKL), taking turns step by
   step (order reversed each round): the per-round speed-ups with their 95% intervals.

Usage: ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296
python benchmarks/bench_linear.py [--rounds 8] [--shape-rounds 7] [--step-rounds 6]
[--models gpt2,tiny]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def reduction_sweep(reductions: list[int], tokens: int, out: int, rounds: int) -> None:
    """Table of TFLOP/s for both libraries per reduction size."""
    from bench_train import alternate

    from densetrain.models.linear import ONEDNN_LINEAR_OP, aten_matmuls, linear, uses_onednn

    print("| K | MKL TFLOP/s | oneDNN TFLOP/s | oneDNN / MKL | densetrain uses |")
    print("|---:|---:|---:|---:|---|")
    for k in reductions:
        x, w = torch.randn(tokens, k), torch.randn(out, k)

        def mkl(_round, x=x, w=w):
            with aten_matmuls():
                linear(x, w)

        def onednn(_round, x=x, w=w):
            # the oneDNN call itself, whatever the threshold says
            ONEDNN_LINEAR_OP(x, w, None, "none", [], "")

        times = alternate({"mkl": mkl, "onednn": onednn}, rounds, warmup=1)
        flops = 2 * tokens * k * out
        t_mkl, t_dnn = statistics.median(times["mkl"]), statistics.median(times["onednn"])
        used = "oneDNN" if uses_onednn(x, w) else "MKL"
        print(f"| {k} | {flops / t_mkl / 1e12:.3f} | {flops / t_dnn / 1e12:.3f} | "
              f"{t_mkl / t_dnn:.2f} | {used} |", flush=True)


def step_shapes(rounds: int) -> None:
    """Table of TFLOP/s for both libraries on the GPT-2-shape step's matmuls."""
    from bench_train import alternate

    from densetrain.models.linear import _onednn_mm

    tokens, dim, ffn, chunk, vocab = 2048, 384, 1536, 1024, 50304
    shapes = [  # name, M, K, N of a [M × K] @ [K × N]
        ("block forward", tokens, dim, ffn),
        ("block forward", tokens, ffn, dim),
        ("block input gradient", tokens, ffn, dim),
        ("block weight gradient", dim, tokens, ffn),
        ("head forward", chunk, dim, vocab),
        ("head input gradient", chunk, vocab, dim),
        ("head weight gradient, as hᵀ @ p", dim, chunk, vocab),
    ]
    print("| matmul [M × K] @ [K × N] | MKL TFLOP/s | oneDNN TFLOP/s | oneDNN / MKL |")
    print("|---|---:|---:|---:|")
    for name, m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        times = alternate({"mkl": lambda _r, a=a, b=b: a @ b,
                           "onednn": lambda _r, a=a, b=b: _onednn_mm(a, b)}, rounds, warmup=1)
        flops = 2 * m * k * n
        t_mkl, t_dnn = statistics.median(times["mkl"]), statistics.median(times["onednn"])
        print(f"| {name}, [{m} × {k}] @ [{k} × {n}] | {flops / t_mkl / 1e12:.3f} | "
              f"{flops / t_dnn / 1e12:.3f} | {t_mkl / t_dnn:.2f} |", flush=True)


def step_ab(models: list[str], rounds: int, warmup: int) -> None:
    """The densetrain step with its own linears against the AVX2 rule and all-MKL linears."""
    import bench_train

    import densetrain.models.linear as linear_module

    for model in models:
        spec = bench_train.MODELS[model]
        fast, avx2_rule, plain = (bench_train._densetrain_step(spec, "fp32", False)[1]
                                  for _ in range(3))

        def with_avx2_rule(batch, step=avx2_rule):
            this_cpu = linear_module.ONEDNN_MAX_REDUCTION
            linear_module.ONEDNN_MAX_REDUCTION = linear_module.ONEDNN_AVX2_MAX_REDUCTION
            try:
                step(batch)
            finally:
                linear_module.ONEDNN_MAX_REDUCTION = this_cpu

        def mkl(batch, step=plain):
            with linear_module.aten_matmuls():
                step(batch)

        sides = {"densetrain linears": fast, "AVX2 rule": with_avx2_rule, "all MKL": mkl}
        times = bench_train.time_steppers(sides, spec, rounds, warmup)
        tokens = spec["batch"] * spec["seq"]
        print(f"{model} (this CPU's limit: {linear_module.ONEDNN_MAX_REDUCTION})")
        for name, values in times.items():
            print(f"  {name}: {tokens / statistics.median(values):,.0f} tokens/s")
        for row in bench_train.ratio_rows(times, [("densetrain linears", "AVX2 rule"),
                                                  ("densetrain linears", "all MKL")]):
            ci = "-".join(f"{v:.3f}" for v in row["ci95"]) if row["ci95"] else "n/a"
            print(f"  speed-up {row['pair']}: median {row['median']:.3f} (95% CI {ci}, "
                  f"min {row['min']:.3f}, max {row['max']:.3f}, {rounds} rounds)", flush=True)


def main() -> None:
    """Parse arguments; run the sweep and the step comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reductions", default="128,256,384,512,768,1024,1536,2048")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=8, help="calls per library and K")
    parser.add_argument("--shape-rounds", type=int, default=7,
                        help="calls per library and step matmul; 0 skips that table")
    parser.add_argument("--step-rounds", type=int, default=6, help="0 skips the step A/B")
    parser.add_argument("--models", default="gpt2", help="bench_train models of the step A/B")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    from densetrain.models.linear import ONEDNN_LINEAR_OP

    if ONEDNN_LINEAR_OP is None:
        raise SystemExit("this torch build has no oneDNN linear")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    reduction_sweep([int(k) for k in args.reductions.split(",")], args.tokens, args.out,
                    args.rounds)
    if args.shape_rounds:
        step_shapes(args.shape_rounds)
    if args.step_rounds:
        step_ab(args.models.split(","), args.step_rounds, args.warmup)


if __name__ == "__main__":
    main()
