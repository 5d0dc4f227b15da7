"""`densetrain scaling sweep | collect | fit | optimal`: IsoFLOP sweeps, scaling-law fits and
compute-optimal allocation (thin wrappers over ``densetrain.scaling``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from densetrain.cli.argtypes import count, number
from densetrain.errors import UserError


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``scaling`` and its sub-commands to ``subparsers``."""
    scaling = subparsers.add_parser("scaling", help="scaling-law sweeps, fits, optimal N and D")
    sub = scaling.add_subparsers(dest="scaling_command", metavar="SUBCOMMAND")
    scaling.set_defaults(func=lambda args: (scaling.print_help(), 2)[1])
    _register_sweep(sub)
    _register_collect(sub)
    _register_fit(sub)
    _register_optimal(sub)


def _register_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="design and run an IsoFLOP sweep, then collect results.csv")
    p.add_argument("--out", required=True, help="sweep directory")
    p.add_argument("--budgets", type=_float_list, default=[1e12, 3e12, 1e13],
                   help="comma-separated FLOP budgets (default 1e12,3e12,1e13)")
    from densetrain.scaling.sweep import SweepConfig

    d = SweepConfig(budgets=[1.0])  # defaults live in one place: the dataclass
    p.add_argument("--sizes-per-budget", type=count(3, "a parabola needs 3 points"),
                   default=d.sizes_per_budget,
                   help="model sizes per budget (default %(default)s)")
    p.add_argument("--n-span", type=number(above=1), default=d.n_span,
                   help="largest/smallest N per budget")
    p.add_argument("--tokens-per-param", type=number(above=0), default=d.tokens_per_param,
                   help="centre of the N range: N = sqrt(C / (6 tokens_per_param))")
    p.add_argument("--param-count", choices=("non_embedding", "total"), default=d.param_count,
                   help="what N counts (default: all parameters, as Chinchilla)")
    p.add_argument("--seq-len", type=count(1), default=d.seq_len,
                   help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch-size", type=count(1), default=d.global_batch_size,
                   help="global batch in sequences")
    p.add_argument("--micro-batch-size", type=count(1), default=None,
                   help="sequences per forward pass (default: the whole batch)")
    p.add_argument("--lr", type=number(above=0), default=d.lr,
                   help="peak learning rate of every run (default %(default)s)")
    p.add_argument("--vocab-size", type=count(1), default=d.vocab_size,
                   help="data.default_vocab_size")
    p.add_argument("--min-steps", type=count(1), default=d.min_steps,
                   help="fewest optimizer steps of a run (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="training seed of every run (default %(default)s)")
    p.add_argument("--preset", default=d.preset,
                   help="preset whose non-size fields every run keeps (default %(default)s)")
    p.add_argument("--launcher", choices=("local", "torchrun", "slurm"), default="local",
                   help="how each run starts (default local)")
    p.add_argument("--nproc-per-node", type=count(1), default=1,
                   help="processes per node of each run (torchrun, slurm)")
    p.add_argument("--nnodes", type=count(1), default=1,
                   help="nodes of each run (torchrun, slurm)")
    p.add_argument("--jobs", type=count(1), default=1, help="local runs at a time")
    p.add_argument("--threads", type=count(1), default=None,
                   help="OMP_NUM_THREADS of each run (default: inherited)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--keep-going", action="store_true", help="continue after a failed run")
    p.add_argument("--loss-field", default="final_val_loss", help="summary.json field to fit")
    p.set_defaults(func=_cmd_sweep, accepts_extra=True)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from densetrain.scaling.runner import run_sweep
    from densetrain.scaling.sweep import SweepConfig, design_sweep

    extra = list(getattr(args, "extra", []))
    bad = [e for e in extra if not e.startswith("--") or "=" not in e]
    if bad:
        raise UserError(f"extra arguments must be --section.field=value overrides, got {bad}")
    cfg = SweepConfig(
        budgets=args.budgets, sizes_per_budget=args.sizes_per_budget, n_span=args.n_span,
        tokens_per_param=args.tokens_per_param, param_count=args.param_count,
        seq_len=args.seq_len, global_batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size or args.batch_size, lr=args.lr,
        vocab_size=args.vocab_size, min_steps=args.min_steps, seed=args.seed,
        preset=args.preset, extra_overrides=extra,
    )
    try:
        points = design_sweep(cfg)
        results = run_sweep(points, cfg, args.out, launcher=args.launcher, dry_run=args.dry_run,
                            keep_going=args.keep_going, nproc_per_node=args.nproc_per_node,
                            nnodes=args.nnodes, jobs=args.jobs, threads=args.threads,
                            loss_field=args.loss_field)
    except RuntimeError as err:  # a run of the sweep failed: not an input error, exit 1
        print(f"densetrain scaling sweep: {err}", file=sys.stderr)
        return 1
    if results is not None:
        print(f"results: {results}")
    return 0


def _register_collect(sub) -> None:
    p = sub.add_parser("collect", help="collect finished runs of a sweep into results.csv")
    p.add_argument("sweep_dir")
    p.add_argument("--loss-field", default="final_val_loss",
                   help="summary.json field to collect (default final_val_loss)")
    p.set_defaults(func=_cmd_collect)


def _cmd_collect(args: argparse.Namespace) -> int:
    from densetrain.scaling.runner import collect_results

    print(f"results: {collect_results(args.sweep_dir, loss_field=args.loss_field)}")
    return 0


def _register_fit(sub) -> None:
    p = sub.add_parser("fit", help="fit Kaplan laws and Chinchilla approaches 1-3, plot PNGs")
    p.add_argument("results", help="results CSV (columns params, tokens, flops, loss)")
    p.add_argument("--out", default=None, help="directory for fit.json and plots "
                   "(default: beside the CSV)")
    p.add_argument("--bootstrap", type=int, default=100, help="bootstrap resamples for CIs")
    p.add_argument("--max-starts", type=count(0, "0 = the whole grid"), default=64,
                   help="L-BFGS starts from the best grid points (0 = the whole grid)")
    p.add_argument("--flops", type=_float_list, default=None,
                   help="budgets at which to print N_opt and D_opt (default: the table's "
                   "budgets and 10x the largest)")
    p.add_argument("--isoflop-window", type=int, default=None,
                   help="fit each IsoFLOP parabola to the K runs nearest the budget's lowest "
                   "loss (default: all runs of the budget)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples")
    p.set_defaults(func=_cmd_fit)


def _cmd_fit(args: argparse.Namespace) -> int:
    from densetrain.scaling.analysis import analyse, analysis_to_json, format_report
    from densetrain.scaling.fit_isoflop import budgets_of
    from densetrain.scaling.plots import plot_frontier, plot_isoflop, plot_residuals
    from densetrain.scaling.results import atomic_write_text, load_results_csv

    table = load_results_csv(args.results)
    out = Path(args.out) if args.out else Path(args.results).parent
    analysis = analyse(table, num_resamples=args.bootstrap, seed=args.seed,
                       max_starts=args.max_starts or None, isoflop_window=args.isoflop_window)
    flops = args.flops
    if flops is None:
        budgets = sorted({float(b) for b in budgets_of(table)})
        flops = budgets + [10 * budgets[-1]]
    print(format_report(analysis, flops))
    atomic_write_text(out / "fit.json", json.dumps(analysis_to_json(analysis), indent=2) + "\n")
    frontier = [f for f in (analysis.envelope, analysis.isoflop) if f is not None]
    written = []
    if analysis.isoflop is not None:
        written.append(plot_isoflop(analysis.isoflop, out / "isoflop.png", table=table))
    if frontier or analysis.parametric is not None:
        written.append(plot_frontier(frontier, analysis.parametric, out / "frontier.png"))
    if analysis.parametric is not None:
        written.append(plot_residuals(table, analysis.parametric, out / "residuals.png"))
    print("wrote: " + ", ".join(str(p) for p in [out / "fit.json", *written]))
    return 0 if analysis.num_fitted else 1


def _register_optimal(sub) -> None:
    p = sub.add_parser("optimal", help="print compute-optimal N and D for a FLOP budget or a "
                       "target loss, optionally counting an inference budget")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--flops", type=number(above=0), help="FLOP budget C (training, plus "
                      "inference when --inference-tokens is given)")
    goal.add_argument("--target-loss", type=number(above=0),
                      help="loss to reach at the least training + inference FLOPs")
    p.add_argument("--inference-tokens", type=number(at_least=0), default=0.0,
                   help="tokens the model will process at inference over its life (2N FLOPs "
                   "each; Sardana et al. 2024). Default 0: Chinchilla's training-only optimum")
    p.add_argument("--fit", default=None,
                   help="fit.json from `scaling fit` (default: Chinchilla's published fit)")
    p.set_defaults(func=_cmd_optimal)


def _cmd_optimal(args: argparse.Namespace) -> int:
    from densetrain.scaling.optimal_report import optimal_report

    text = optimal_report(flops=args.flops, target_loss=args.target_loss,
                          inference_tokens=args.inference_tokens, fit_path=args.fit)
    print(text)
    return 0
