"""Causal attention forward + backward inside ``torch.compile`` on CPU: SDPA against the
written-out attention that compiled low-precision CPU regions take
(`densetrain.models.attention._compiled_cpu_attention`), per sequence length and dtype.

Both sides are compiled (inductor) and take turns call by call (order reversed every round) on
the same [batch, heads, S, head_dim] inputs; the table gives each side's median and the
per-round speed-up of the written-out attention with its 95% interval.
``COMPILED_CPU_ATTENTION_MAX_SEQ`` is chosen with this table and the written-out side's memory
(it holds [batch, heads, S, S] probabilities per layer for backward).

Usage: ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296
python benchmarks/bench_attention.py [--seqs 256,512,1024] [--rounds 9]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def compare(seq: int, dtype: torch.dtype, heads: int, kv_heads: int, rounds: int) -> str:
    """One table row: SDPA and the written-out attention at ``seq`` positions."""
    from bench_train import alternate, ratio_rows

    from densetrain.models.attention import _compiled_cpu_attention

    batch, head_dim = 8, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, seq, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    qkv.requires_grad_(True)
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype)

    def split(x):
        q = x[:, :, :heads].transpose(1, 2)
        k = x[:, :, heads : heads + kv_heads].transpose(1, 2)
        v = x[:, :, heads + kv_heads :].transpose(1, 2)
        return q, k, v

    def sdpa(x):
        return F.scaled_dot_product_attention(*split(x), is_causal=True,
                                              enable_gqa=kv_heads != heads)

    def written(x):
        return _compiled_cpu_attention(*split(x))

    sides = {"sdpa": torch.compile(sdpa), "written": torch.compile(written)}

    def call(fn):
        def run(_round):
            qkv.grad = None
            fn(qkv).backward(grad_out)
        return run

    times = alternate({name: call(fn) for name, fn in sides.items()}, rounds, warmup=2)
    (row,) = ratio_rows(times, [("written", "sdpa")])
    ci = "-".join(f"{v:.2f}" for v in row["ci95"]) if row["ci95"] else "n/a"
    gqa = f", GQA {heads}/{kv_heads}" if kv_heads != heads else ""
    return (f"| {seq} | {str(dtype).removeprefix('torch.')}{gqa} | "
            f"{statistics.median(times['sdpa']) * 1e3:.1f} ms | "
            f"{statistics.median(times['written']) * 1e3:.1f} ms | {row['median']:.2f} ({ci}) |")


def main() -> None:
    """Parse arguments; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="256,512,1024")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| S | dtype | SDPA | written out | speed-up (95% CI) |")
    print("|---|---|---|---|---|")
    for seq in (int(s) for s in args.seqs.split(",")):
        print(compare(seq, torch.bfloat16, 6, 6, args.rounds), flush=True)
    first = int(args.seqs.split(",")[0])
    print(compare(first, torch.bfloat16, 6, 2, args.rounds), flush=True)
    print(compare(first, torch.float32, 6, 6, args.rounds), flush=True)


if __name__ == "__main__":
    main()
