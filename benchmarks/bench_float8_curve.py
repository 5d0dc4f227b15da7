"""float8 training against bf16: the loss curves of the same job over a few hundred steps.

    python benchmarks/bench_float8_curve.py [--steps 300] [--recipes tensorwise,rowwise]
        [--out float8-curve] [--device auto] [--dim 64] [--layers 2] [--seq 64]

Trains the tiny job (``densetrain.testing.TINY_OVERRIDES``, widened with ``--dim``/``--layers``
/``--seq``) once in bf16 and once per float8 recipe (``training.dtype=float8``: torchao's
Float8Linear in the blocks), same seed, data and schedule, on ``--device`` (a GPU when there is
one). It prints the loss every ``--every`` steps (each the mean of the ``--every`` steps up to
it), the largest gap between the float8 and the bf16 curves so smoothed, the validation losses,
and each run's tokens/s; it writes ``loss.png`` and ``curves.json`` under ``--out``. On a CPU,
torchao's ``_scaled_mm`` is emulated: the numerics are those of float8, the speed is not
(benchmarks/gpu.py measures that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path


def _run(dtype: str, recipe: str, args, cache: Path, work: Path) -> dict:
    from densetrain.config import load_job_config
    from densetrain.testing import tiny_job_overrides
    from densetrain.train import read_metrics, train

    run_dir = work / f"{dtype}-{recipe}"
    head_dim = 16
    extra = (f"--model.dim={args.dim}", f"--model.embed_dim={args.dim}",
             f"--model.num_heads={args.dim // head_dim}",
             f"--model.num_kv_heads={max(args.dim // head_dim // 2, 1)}",
             f"--model.ffn_dim={2 * args.dim}", f"--model.num_layers={args.layers}",
             f"--data.seq_len={args.seq}", f"--training.steps={args.steps}",
             f"--schedule.warmup_steps={max(args.steps // 20, 1)}",
             f"--eval.interval={args.every * 4}", "--eval.sample_tokens=0",
             "--checkpoint.enabled=false", "--logging.plot=false",
             f"--training.device={args.device}", f"--training.dtype={dtype}",
             f"--training.float8_recipe={recipe}")
    train(load_job_config(None, tiny_job_overrides(cache_dir=str(cache), run_dir=str(run_dir),
                                                   extra=extra)))
    records = read_metrics(run_dir)
    return {"loss": [r["loss"] for r in records if "loss" in r],
            "val": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records
                                              if "tokens_per_s" in r)}


def _smooth(losses: list[float], every: int) -> list[float]:
    return [statistics.fmean(losses[i - every:i]) for i in range(every, len(losses) + 1, every)]


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from densetrain.scaling.plots import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in curves.items():
        ax.plot(range(1, len(run["loss"]) + 1), run["loss"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="float8-curve")
    args = parser.parse_args()
    if args.dim % 16 or args.steps < args.every:
        parser.error("--dim must be a multiple of 16 and --steps at least --every")
    work = Path(tempfile.mkdtemp(prefix="densetrain-float8-"))
    cache = work / "cache"
    curves = {"bf16": _run("bf16", "tensorwise", args, cache, work)}
    for recipe in args.recipes.split(","):
        curves[f"float8 {recipe}"] = _run("float8", recipe, args, cache, work)
    smooth = {name: _smooth(run["loss"], args.every) for name, run in curves.items()}
    steps = list(range(args.every, args.steps + 1, args.every))
    print("| step | " + " | ".join(curves) + " |")
    print("|---:|" + "---:|" * len(curves))
    for i, step in enumerate(steps):
        print(f"| {step} | " + " | ".join(f"{smooth[n][i]:.4f}" for n in curves) + " |")
    for name in list(curves)[1:]:
        gap = max(abs(a - b) for a, b in zip(smooth[name], smooth["bf16"], strict=True))
        vals = [f"{curves[name]['val'][s] - curves['bf16']['val'][s]:+.4f}"
                for s in sorted(curves["bf16"]["val"]) if s in curves[name]["val"]]
        print(f"{name}: largest gap to bf16 over {args.every}-step means {gap:.4f} nats; "
              f"validation loss minus bf16's at each evaluation: {', '.join(vals)}")
    for name, run in curves.items():
        print(f"{name}: {run['tokens_per_s']:,.0f} tokens/s (median), final val "
              f"{run['val'][max(run['val'])]:.4f}" if run["val"] else name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".curves.json.tmp"
    tmp.write_text(json.dumps({"args": vars(args), "curves": curves}, indent=1))
    os.replace(tmp, out / "curves.json")
    try:
        _plot(curves, out / "loss.png")
    except ModuleNotFoundError as e:  # a bare GPU image may lack matplotlib: the JSON has all
        print(f"no plot ({e}); wrote {out / 'curves.json'}")
    else:
        print(f"wrote {out / 'loss.png'} and {out / 'curves.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
