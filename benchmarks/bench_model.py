"""Forward+backward tokens/s of densetrain's Transformer against the same architecture in
Hugging Face ``transformers`` (LlamaForCausalLM, GPT2LMHeadModel; sdpa attention, fp32, CPU).

Variants take turns step by step in one process (the machine is shared and noisy, so only
ratios of medians measured side by side mean much). Peak RSS is measured separately, one fresh
subprocess per variant, so that one model's allocations do not hide another's.

    python benchmarks/bench_model.py            # 6 layers, width 384, 6 heads, seq 256, batch 8
    python benchmarks/bench_model.py --quick    # a small shape for a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from densetrain.models import ModelConfig, Transformer
from densetrain.models.hf import build_transformers_model
from densetrain.models.presets.gpt2 import gpt2_config
from densetrain.models.presets.llama import llama_config


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Model and batch shape shared by all variants."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    ffn_llama: int


FULL = Shape(layers=6, dim=384, heads=6, kv_heads=2, seq=256, batch=8, ffn_llama=1024)
QUICK = Shape(layers=2, dim=128, heads=4, kv_heads=2, seq=128, batch=4, ffn_llama=352)
VOCAB = {"llama": 32000, "gpt2": 50257}


def densetrain_config(family: str, shape: Shape, vocab: int) -> ModelConfig:
    """The benchmark model: a LLaMA- or GPT-2-style config from the preset family builders."""
    if family == "llama":
        return llama_config(
            family="llama", dim=shape.dim, num_layers=shape.layers, num_heads=shape.heads,
            num_kv_heads=shape.kv_heads, ffn_dim=shape.ffn_llama, published_params=0,
            vocab_size=vocab, max_seq_len=shape.seq, norm_eps=1e-6,
        )
    return gpt2_config(
        dim=shape.dim, num_layers=shape.layers, num_heads=shape.heads, published_params=0,
        vocab_size=vocab, max_seq_len=shape.seq,
    )


def hf_model(family: str, shape: Shape, vocab: int) -> torch.nn.Module:
    """The ``transformers`` twin of ``densetrain_config`` (sdpa attention, no dropout)."""
    return build_transformers_model(
        densetrain_config(family, shape, vocab), family, attn_implementation="sdpa"
    )


def make_step(variant: str, family: str, shape: Shape):
    """Build one variant and return a closure running forward+loss+backward on a fixed batch."""
    vocab = VOCAB[family]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (shape.batch, shape.seq), generator=generator)
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    if variant == "transformers":
        model = hf_model(family, shape, vocab).train()

        def step() -> float:
            # labels are shifted inside transformers; the token count matches densetrain's.
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.item()

        return step
    model = Transformer(densetrain_config(family, shape, vocab)).train()
    model.init_weights(seed=0)
    chunk = 1024 if variant == "densetrain" else None

    def step() -> float:
        loss = model.compute_loss(tokens, targets, chunk_size=chunk).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


VARIANTS = ("densetrain", "densetrain-full-logits", "transformers")


def measure_speed(shape: Shape, rounds: int, warmup: int) -> dict:
    """Alternate the variants step by step; return median seconds per step for each."""
    results = {}
    for family in ("llama", "gpt2"):
        steps = {v: make_step(v, family, shape) for v in VARIANTS}
        for _ in range(warmup):
            for step in steps.values():
                step()
        times = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for variant, step in steps.items():
                start = time.perf_counter()
                step()
                times[variant].append(time.perf_counter() - start)
        print(f"{family}: done", file=sys.stderr, flush=True)
        tokens = shape.batch * shape.seq
        medians = {v: statistics.median(t) for v, t in times.items()}
        results[family] = {
            v: {"tokens_per_s": tokens / m, "median_step_s": m} for v, m in medians.items()
        }
        for variant in VARIANTS:
            ratio = medians["transformers"] / medians[variant]
            results[family][variant]["speed_vs_transformers"] = ratio
        del steps
    return results


def peak_rss_mib(variant: str, family: str, quick: bool) -> float:
    """Peak RSS of a fresh process that builds one variant and runs two steps."""
    args = [sys.executable, __file__, "--rss-child", variant, family] + (
        ["--quick"] if quick else []
    )
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def measure_gqa(rounds: int = 15) -> dict:
    """Median fwd+bwd ms of causal SDPA with 2 kv heads for 8 query heads: ``enable_gqa=True``
    against expanding the kv heads with ``repeat_interleave`` (the choice made in attention.py)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q = torch.randn(8, 8, 256, 64, requires_grad=True)
    k = torch.randn(8, 2, 256, 64, requires_grad=True)
    v = torch.randn(8, 2, 256, 64, requires_grad=True)

    def gqa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def expand() -> None:
        kk, vv = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        F.scaled_dot_product_attention(q, kk, vv, is_causal=True).sum().backward()

    times = {"enable_gqa": [], "repeat_interleave": []}
    for _ in range(rounds):
        for name, fn in (("enable_gqa", gqa), ("repeat_interleave", expand)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _peak_rss_kib() -> float:
    """This process's peak resident set (VmHWM). ``ru_maxrss`` is not used: Linux carries it
    over from the parent across fork+exec, so every child would report the parent's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    """Parse arguments, run the benchmark, print a JSON summary and a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shape, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--gqa", action="store_true", help="only the GQA attention microbenchmark")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--rss-child", nargs=2, metavar=("VARIANT", "FAMILY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else FULL
    if args.gqa:
        print(json.dumps(measure_gqa(), indent=2))
        return
    if args.rss_child:
        step = make_step(args.rss_child[0], args.rss_child[1], shape)
        step()
        step()
        print(_peak_rss_kib() / 1024)
        return
    rounds = args.rounds or (3 if args.quick else 10)
    warmup = 1 if args.quick else args.warmup
    speed = measure_speed(shape, rounds=rounds, warmup=warmup)
    for family in speed:
        for variant in VARIANTS:
            speed[family][variant]["peak_rss_mib"] = peak_rss_mib(variant, family, args.quick)
    print(
        json.dumps(
            {
                "shape": shape.__dict__,
                "rounds": rounds,
                "threads": args.threads,
                "torch": torch.__version__,
                "results": speed,
            },
            indent=2,
        )
    )
    print("\n| model | variant | tokens/s | × transformers | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for family, by_variant in speed.items():
        for variant, r in by_variant.items():
            print(
                f"| {family} | {variant} | {r['tokens_per_s']:.0f} | "
                f"{r['speed_vs_transformers']:.3f} | {r['peak_rss_mib']:.0f} |"
            )


if __name__ == "__main__":
    main()
