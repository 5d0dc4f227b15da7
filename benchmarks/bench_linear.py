"""fp32 CPU linears: MKL (``F.linear``) against oneDNN (`densetrain.models.linear`), per
reduction size and in the whole training step.

1. ``[tokens × K] @ [K × out]`` for K in ``--reductions``: both libraries alternating call by
   call; the speed ratio oneDNN/MKL per K (what ``onednn_reduction_limit`` is chosen from;
   the last column says which library densetrain's rule picks on this CPU).
2. The densetrain training step of ``bench_train``'s GPT-2 shape with its linears as they are
   against the same step inside `aten_matmuls` (every linear on MKL), the two taking turns step
   by step (order reversed each round): the per-round speed-up with its spread.

Usage: ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296
python benchmarks/bench_linear.py [--rounds 8] [--step-rounds 6]``.
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


def step_ab(rounds: int, warmup: int) -> None:
    """The densetrain GPT-2-shape step with its own linears against all-MKL linears."""
    import bench_train

    from densetrain.models.linear import aten_matmuls

    spec = bench_train.MODELS["gpt2"]
    _, fast = bench_train._densetrain_step(spec, "fp32", False)
    _, plain = bench_train._densetrain_step(spec, "fp32", False)

    def mkl(batch):
        with aten_matmuls():
            plain(batch)

    times = bench_train.time_steppers({"densetrain linears": fast, "all MKL": mkl}, spec,
                                      rounds, warmup)
    tokens = spec["batch"] * spec["seq"]
    for name, values in times.items():
        print(f"{name}: {tokens / statistics.median(values):,.0f} tokens/s")
    (row,) = bench_train.ratio_rows(times, [("densetrain linears", "all MKL")])
    print(f"speed-up densetrain linears / all MKL: median {row['median']:.3f} "
          f"(min {row['min']:.3f}, max {row['max']:.3f}, {rounds} rounds)")


def main() -> None:
    """Parse arguments; run the sweep and the step comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reductions", default="128,256,384,512,768,1024,1536,2048")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=8, help="calls per library and K")
    parser.add_argument("--step-rounds", type=int, default=6, help="0 skips the step A/B")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    from densetrain.models.linear import ONEDNN_LINEAR_OP

    if ONEDNN_LINEAR_OP is None:
        raise SystemExit("this torch build has no oneDNN linear")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    reduction_sweep([int(k) for k in args.reductions.split(",")], args.tokens, args.out,
                    args.rounds)
    if args.step_rounds:
        step_ab(args.step_rounds, args.warmup)


if __name__ == "__main__":
    main()
