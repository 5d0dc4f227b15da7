"""Training-step throughput, MFU and peak RSS on CPU: densetrain against a plain GPT and
Hugging Face transformers.

Timing: every variant is built in one process and the variants take turns step by step (the order
reversed every round), so that load from other processes on a shared machine hits them alike;
the report gives median step times. Memory: with ``--rss`` each variant also runs a few steps in
its own child process, whose peak RSS is then its own. Both sides run the same architecture,
the same random token batches, fused AdamW (β2 0.95, weight decay 0.1) and clipping at 1.0:

* densetrain: the model's ``forward`` with targets (the chunked output projection + loss), through
  the trainer's own `train_step`; eager or ``torch.compile`` (per block), fp32 or bf16 autocast;
  its fp32 CPU matmuls go to oneDNN where it is the faster library (all of them on AVX-512
  CPUs not made by Intel, short reductions elsewhere: `densetrain.models.linear`).
* plain: ``plain_gpt.PlainGPT`` (GPT-2 shape only), a one-module GPT written the way the
  minimal single-file GPTs are: eager or ``torch.compile`` of the whole model, SDPA, the full
  logits + ``F.cross_entropy``, torch's default AdamW (no fused kernel), clipping at 1.0.
* transformers: ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` with SDPA attention and
  ``labels=`` loss; fp32 or bf16 autocast.

MFU uses `flops_per_token_palm` and a matmul-probe peak measured in the parent before and after
the runs (both printed; the higher is the ceiling). ``--ratios A/B,...`` prints the per-round
ratio of step times (B's time over A's, i.e. A's speed-up) with its median, the median's 95%
confidence interval and the spread: rounds are adjacent in time, so load from other processes
hits both sides of a ratio alike.
Usage: ``python benchmarks/bench_train.py [--models tiny,gpt2] [--rounds 5] [--rss]``.
Allocator: ``--malloc tuned`` sets ``GLIBC_TUNABLES`` (mmap off, no trimming) in the children,
``--malloc live`` makes every block of 64 KiB or more its own mapping, so that their peak RSS
is that of live memory; each child runs ``--rss-steps`` steps (10).
Loss chunk: densetrain's loss runs 1,024 positions at a time; ``densetrain-fp32@512`` or
``densetrain-fp32@full`` (full logits) compares other chunks, e.g. ``--models tiny --variants
densetrain-fp32,densetrain-fp32@full --ratios densetrain-fp32/densetrain-fp32@full``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from densetrain.train.host_malloc import TUNED_GLIBC_TUNABLES

VARIANTS = {
    "densetrain-fp32": ("densetrain", "fp32", False),
    "densetrain-fp32-compile": ("densetrain", "fp32", True),
    "densetrain-bf16": ("densetrain", "bf16", False),
    "densetrain-bf16-compile": ("densetrain", "bf16", True),
    "plain-fp32": ("plain", "fp32", False),
    "plain-fp32-compile": ("plain", "fp32", True),
    "plain-bf16-compile": ("plain", "bf16", True),
    "hf-fp32": ("hf", "fp32", False),
    "hf-bf16": ("hf", "bf16", False),
}
MODELS = {
    # The GPT-2-124M shape shrunk for 2 cores: 6 layers, width 384, 6 heads, seq 256, batch 8.
    "gpt2": dict(family="gpt2", dim=384, num_layers=6, num_heads=6, vocab=50304, seq=256, batch=8),
    # The tiny-llama preset (4 layers, width 128, GQA 4/2 heads, SwiGLU 352) with an 8192 vocab.
    "tiny": dict(family="llama", dim=128, num_layers=4, num_heads=4, kv_heads=2, ffn=352,
                 vocab=8192, seq=256, batch=16),
}
TUNED_MALLOC = TUNED_GLIBC_TUNABLES  # what `densetrain train` sets for itself
# Every allocation of 64 KiB or more its own mapping, unmapped when freed: the children's peak
# RSS is then the peak of live tensors (plus the small blocks glibc keeps), not of a heap that
# the tuned allocator never returns and whose holes depend on the order of frees.
LIVE_MALLOC = "glibc.malloc.mmap_threshold=65536"
MALLOCS = {"default": None, "tuned": TUNED_MALLOC, "live": LIVE_MALLOC}


def densetrain_config(spec: dict):
    """The densetrain `ModelConfig` of a benchmark model."""
    from densetrain.models.presets.gpt2 import gpt2_config
    from densetrain.models.presets.llama import llama_config

    if spec["family"] == "gpt2":
        return gpt2_config(
            dim=spec["dim"], num_layers=spec["num_layers"], num_heads=spec["num_heads"],
            published_params=0, vocab_size=spec["vocab"], max_seq_len=spec["seq"],
        )
    return llama_config(
        family="llama", dim=spec["dim"], num_layers=spec["num_layers"],
        num_heads=spec["num_heads"], num_kv_heads=spec["kv_heads"], ffn_dim=spec["ffn"],
        published_params=0, vocab_size=spec["vocab"], max_seq_len=spec["seq"], norm_eps=1e-5,
    )


def hf_model(spec: dict) -> torch.nn.Module:
    """The ``transformers`` twin of ``densetrain_config`` (sdpa attention, no dropout)."""
    from densetrain.models.hf import build_transformers_model

    return build_transformers_model(
        densetrain_config(spec), spec["family"], attn_implementation="sdpa"
    )


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """transformers' side: the optimizer its Trainer uses by default with torch >= 2.8
    (``optim="adamw_torch_fused"``), decay on every parameter."""
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                             fused=True)


def _densetrain_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """densetrain's side: what ``densetrain train`` builds (fused AdamW over decay / no-decay
    groups)."""
    from densetrain.optim import OptimConfig, build_optimizer

    return build_optimizer(model, OptimConfig(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1))


def _densetrain_step(spec: dict, dtype: str, compile_: bool, loss_chunk: int | None = 1024):
    from densetrain.models import Transformer
    from densetrain.optim.interface import StandardOptimizer
    from densetrain.parallel.compile import apply_compile
    from densetrain.parallel.model import SpmdModel, model_loss_fn
    from densetrain.train.device import autocast_factory
    from densetrain.train.step import train_step

    cfg = densetrain_config(spec)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    if compile_:
        apply_compile(model)
    opt = StandardOptimizer(model, _densetrain_optimizer(model))
    autocast = autocast_factory(torch.device("cpu"), dtype)
    laid_out = SpmdModel(module=model, loss_fn=model_loss_fn(loss_chunk))

    def step(batch) -> float:
        out = train_step(
            laid_out, opt, batch, micro_batch_size=batch.inputs.shape[0], grad_clip=1.0,
            autocast=autocast, nan_policy="stop", step=1,
        )
        return float(out.loss)

    return cfg, step


def _eager_step(model: torch.nn.Module, opt: torch.optim.Optimizer, dtype: str, loss_of):
    """A reference side's step: ``loss_of(batch)`` under bf16 autocast or none, backward,
    clipping at 1.0, the optimizer step."""
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if dtype == "bf16" else contextlib.nullcontext
    )

    def step(batch) -> float:
        with autocast():
            loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _hf_step(spec: dict, dtype: str):
    model = hf_model(spec)
    model.train()
    return _eager_step(model, _adamw(model), dtype,
                       lambda batch: model(input_ids=batch.inputs, labels=batch.inputs).loss)


def _plain_step(spec: dict, dtype: str, compile_: bool):
    from plain_gpt import PlainGPT, plain_adamw

    if spec["family"] != "gpt2":
        raise SystemExit(f"the plain GPT has the GPT-2 architecture only, not {spec['family']}")
    model = PlainGPT(vocab=spec["vocab"], seq=spec["seq"], dim=spec["dim"],
                     layers=spec["num_layers"], heads=spec["num_heads"])
    forward = torch.compile(model) if compile_ else model
    return _eager_step(model, plain_adamw(model), dtype,
                       lambda batch: forward(batch.inputs, batch.targets))


def parse_variant(variant: str) -> tuple[str, str, bool, int | None]:
    """``(impl, dtype, compile, loss chunk)`` of a variant name: one of `VARIANTS`, a densetrain
    one optionally with ``@N`` (its loss in chunks of N positions; 1024 without) or ``@full``
    (the full logits), e.g. ``densetrain-fp32@full``."""
    base, _, chunk = variant.partition("@")
    if base not in VARIANTS or (chunk and not base.startswith("densetrain")):
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}, a "
                         "densetrain one optionally with @N or @full (its loss chunk)")
    if chunk and chunk != "full" and not (chunk.isdigit() and int(chunk) > 0):
        raise SystemExit(f"variant {variant!r}: the loss chunk after @ is a positive number "
                         f"of positions or 'full', not {chunk!r}")
    loss_chunk = None if chunk == "full" else int(chunk or 1024)
    return (*VARIANTS[base], loss_chunk)


def _stepper(variant: str, spec: dict):
    impl, dtype, compile_, loss_chunk = parse_variant(variant)
    torch.manual_seed(0)
    if impl == "densetrain":
        return _densetrain_step(spec, dtype, compile_, loss_chunk)[1]
    if impl == "plain":
        return _plain_step(spec, dtype, compile_)
    return _hf_step(spec, dtype)


def _batches(spec: dict, count: int):
    from densetrain.data import Batch

    gen = torch.Generator().manual_seed(0)
    for _ in range(count):
        tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=gen)
        yield Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())


def time_alternating(variants: list[str], model_name: str, rounds: int,
                     warmup: int) -> dict[str, list[float]]:
    """Step seconds of each variant per timed round, all in this process, taking turns step by
    step (the order reversed every round)."""
    spec = MODELS[model_name]
    return time_steppers({v: _stepper(v, spec) for v in variants}, spec, rounds, warmup)


def time_steppers(steppers: dict, spec: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Step seconds per timed round of each ``steppers[name](batch)`` on ``spec``'s batches,
    taking turns step by step (the order reversed every round)."""
    batches = list(_batches(spec, warmup + rounds))
    calls = {name: (lambda index, step=step: step(batches[index]))
             for name, step in steppers.items()}
    return alternate(calls, rounds, warmup)


def alternate(calls: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per timed round of each ``calls[name](round_index)``, all taking turns round by
    round (the order reversed every round); the first ``warmup`` rounds are not timed."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            calls[name](index)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval for the median of ``values``: the order statistics
    x(k) and x(n-k+1) with the largest k for which P(Binomial(n, 1/2) < k) <= (1 - confidence)/2
    (the sign-test interval; it assumes only independent rounds). None when ``values`` are too
    few for that confidence (fewer than 6 for 95%)."""
    from scipy.stats import binom

    ordered, n = sorted(values), len(values)
    k = 0
    while k + 1 <= n // 2 and binom.cdf(k, n, 0.5) <= (1 - confidence) / 2:
        k += 1
    return None if k == 0 else (ordered[k - 1], ordered[n - k])


def ratio_rows(times: dict[str, list[float]], pairs: list[tuple[str, str]]) -> list[dict]:
    """Per-round speed-up of A over B (B's step time / A's) for each pair: its median, the
    median's 95% confidence interval (`median_interval`), the spread (min, max) and, beside
    them, the ratio of the two sides' median step times."""
    rows = []
    for a, b in pairs:
        per_round = [tb / ta for ta, tb in zip(times[a], times[b], strict=True)]
        interval = median_interval(per_round)
        rows.append({"pair": f"{a}/{b}", "median": statistics.median(per_round),
                     "ci95": list(interval) if interval else None,
                     "min": min(per_round), "max": max(per_round),
                     "of_medians": statistics.median(times[b]) / statistics.median(times[a]),
                     "rounds": per_round})
    return rows


def run_child(variant: str, model_name: str, steps: int) -> dict:
    """Run ``steps`` steps of one variant; report this process's peak RSS."""
    from densetrain.train.device import peak_rss_bytes

    spec = MODELS[model_name]
    step = _stepper(variant, spec)
    for batch in _batches(spec, steps):
        step(batch)
    return {"variant": variant, "model": model_name, "peak_rss_gib": peak_rss_bytes() / 2**30}


def _spawn_rss(variant: str, model_name: str, args: argparse.Namespace) -> float:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if MALLOCS[args.malloc]:
        env["GLIBC_TUNABLES"] = MALLOCS[args.malloc]
    cmd = [sys.executable, __file__, "--child", variant, "--models", model_name,
           "--rounds", str(args.rss_steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} on {model_name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_gib"]


def machine_line() -> str:
    """What the results depend on: the CPU's name and vendor, its matmul instruction sets as
    torch sees them, threads, torch, the allocator tunables of this process."""
    import platform

    from densetrain.models.linear import cpu_has_amx, cpu_vendor, cpuinfo_field

    name = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return (f"machine: {name} ({cpu_vendor() or 'unknown vendor'}), torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, AMX {'yes' if cpu_has_amx() else 'no'}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, GLIBC_TUNABLES="
            f"{os.environ.get('GLIBC_TUNABLES', '(unset)')}")


def main() -> None:
    """Parse arguments; time the variants alternating in this process; optionally measure RSS."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,gpt2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rss", action="store_true", help="peak RSS per variant (children)")
    parser.add_argument("--malloc", choices=tuple(MALLOCS), default="default",
                        help="allocator of the RSS children (timing uses this process's): "
                        "glibc's default, tuned (mmap off, no trimming: what densetrain train "
                        "sets) or live (every block of 64 KiB or more unmapped when freed, so "
                        "peak RSS follows live memory)")
    parser.add_argument("--rss-steps", type=int, default=10,
                        help="steps of each RSS child (the heap's peak creeps up over the "
                        "first steps with the tuned allocator)")
    parser.add_argument("--child", default="")
    parser.add_argument("--json", default="", help="also write all results to this file")
    parser.add_argument("--ratios", default="",
                        help="pairs A/B,... whose per-round speed-up A over B is reported")
    args = parser.parse_args()
    for variant in args.variants.split(","):
        parse_variant(variant)  # a bad name fails here, before the probe or any model
    if args.child:
        print(json.dumps(run_child(args.child, args.models, args.rounds)))
        return
    from densetrain.models import flops_per_token_palm
    from densetrain.train.metrics import measure_cpu_peak_flops

    print(machine_line(), flush=True)

    def probe() -> dict[str, float]:
        found = {d: measure_cpu_peak_flops(d, runs=10, seconds_per_run=0.2, fresh=True)
                 for d in ("fp32", "bf16")}
        print(f"peak (matmul probe, {torch.get_num_threads()} threads): fp32 "
              f"{found['fp32'] / 1e12:.3f}, bf16 {found['bf16'] / 1e12:.3f} TFLOP/s", flush=True)
        return found

    peaks = probe()
    variants = args.variants.split(",")
    if peaks["bf16"] < peaks["fp32"] and any(parse_variant(v)[1] == "bf16" for v in variants):
        print(f"note: bf16 matmuls are slower than fp32 ones on this CPU (CPU capability "
              f"{torch.backends.cpu.get_cpu_capability()}, no AVX512-BF16 or AMX): its bf16 "
              "variants time torch's fallback loops, not a fast mode", flush=True)
    pairs = [tuple(p.split("/")) for p in args.ratios.split(",") if p]
    results: list[dict] = []
    ratios: list[dict] = []
    for model_name in args.models.split(","):
        spec = MODELS[model_name]
        times = time_alternating(variants, model_name, args.rounds, args.warmup)
        for row in ratio_rows(times, pairs):
            ratios.append({"model": model_name, **row})
            print(json.dumps(ratios[-1]), flush=True)
        for variant, step_times in times.items():
            step_s = statistics.median(step_times)
            row = {
                "model": model_name, "variant": variant, "median_step_s": step_s,
                "tokens_per_s": spec["batch"] * spec["seq"] / step_s,
                "flops_per_token": flops_per_token_palm(densetrain_config(spec), spec["seq"]),
                "peak_rss_gib": _spawn_rss(variant, model_name, args) if args.rss else None,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    after = probe()
    peaks = {d: max(peaks[d], after[d]) for d in peaks}
    print(_table(results, peaks, args.malloc))
    for r in ratios:
        ci = (f"95% CI {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}, " if r["ci95"]
              else "too few rounds for a 95% CI, ")
        print(f"{r['model']} {r['pair']}: per-round median {r['median']:.3f} ({ci}min "
              f"{r['min']:.3f}, max {r['max']:.3f}, {len(r['rounds'])} rounds); ratio of the "
              f"median steps {r['of_medians']:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"peaks": peaks, "results": results, "ratios": ratios}, f, indent=2)


def _table(results: list[dict], peaks: dict, malloc: str) -> str:
    lines = [f"\nallocator: {malloc}",
             "| model | variant | tokens/s | MFU vs fp32 peak | MFU vs own-dtype peak | "
             "peak RSS GiB |", "|---|---|---|---|---|---|"]
    for r in results:
        tps, flops, dtype = r["tokens_per_s"], r["flops_per_token"], parse_variant(r["variant"])[1]
        rss = "-" if r["peak_rss_gib"] is None else f"{r['peak_rss_gib']:.2f}"
        lines.append(
            f"| {r['model']} | {r['variant']} | {tps:,.0f} | "
            f"{100 * tps * flops / peaks['fp32']:.0f}% | {100 * tps * flops / peaks[dtype]:.0f}% "
            f"| {rss} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
