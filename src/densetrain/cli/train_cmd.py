"""`densetrain train [CONFIG] [--section.field=value ...]`: run a training job.

Without CONFIG the embedded default runs: a tiny LLaMA-style model on the Python standard
library sources with a BPE tokenizer trained on them; no download and no setup. Overrides use
dotted paths, e.g. ``--training.steps=50 --model.num_layers=4 --logging.run_dir=runs/x``;
``--training.steps 50`` (a space instead of ``=``) is the same. CONFIG, when given, comes first.

Speed on CPU: the allocator matters (large per-step tensors are otherwise mmap'ed and faulted in
again each step). The command restarts itself once with glibc's malloc tunables set so that they
stay in the heap (``--training.host_allocator=system`` keeps the defaults; a ``GLIBC_TUNABLES``
or an ``LD_PRELOAD``ed allocator of your own is left alone). Threads: each CPU rank runs
its share of the host's cores (cores // LOCAL_WORLD_SIZE) unless ``OMP_NUM_THREADS`` is set;
torchrun sets it to 1 for several ranks, and the start line says when that leaves cores idle.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` sub-command."""
    parser = subparsers.add_parser(
        "train",
        help="train a model (no arguments: the embedded tiny default)",
        description=__doc__,
        usage="densetrain train [CONFIG.toml] [--section.field[=]value ...] [--print-config]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # CONFIG is taken from the unparsed words (split_config_and_overrides), not as an argparse
    # positional: argparse would take the value of ``--training.steps 10`` as the config file.
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="build and step the job's real code on fake tensors as simulated ranks of "
             "--world-size, and report each rank's memory and collectives (no training)")
    parser.add_argument(
        "--world-size", type=int, default=0, metavar="N",
        help="with --dry-run: the world size to simulate (the layout's degrees must divide it)")
    parser.add_argument(
        "--ranks", default="", metavar="R[,R...]",
        help="with --dry-run: the ranks to simulate, one process each (default: one per role: "
             "the first and last rank, and a middle pipeline stage)")
    parser.add_argument(
        "--fit-gib", type=float, default=76.0, metavar="GIB",
        help="with --dry-run: the memory a rank may hold (default 76: an 80 GB GPU less what a "
             "CPU trace cannot see); a rank over it is listed with the changes that would fit")
    parser.set_defaults(func=run_train, accepts_extra=True)


def split_config_and_overrides(words: list[str]) -> tuple[str | None, list[str]]:
    """``(CONFIG or None, overrides)``: a first word that is not an option is the config file."""
    if words and not words[0].startswith("-"):
        return words[0], list(words[1:])
    return None, list(words)


def run_dry(job, args: argparse.Namespace) -> int:
    """``train --dry-run``: each simulated rank in its own process, then the report."""
    from densetrain.dryrun.report import default_ranks, format_report
    from densetrain.dryrun.run import dry_run_ranks
    from densetrain.errors import UserError
    from densetrain.parallel.mesh import ParallelDims

    if not args.dry_run:
        raise UserError("--world-size and --ranks go with --dry-run")
    if os.environ.get("WORLD_SIZE") or os.environ.get("TORCHELASTIC_RUN_ID"):
        raise UserError("--dry-run simulates the ranks itself: run it as one process, not under "
                        "torchrun")
    if args.world_size < 1:
        raise UserError("--dry-run needs --world-size N (N >= 1): the world size to simulate")
    try:
        dims = ParallelDims.from_config(job.parallel, args.world_size)
    except ValueError as err:
        raise UserError(f"--world-size {args.world_size}: {err}") from None
    if args.ranks:
        try:
            ranks = sorted({int(word) for word in args.ranks.split(",")})
        except ValueError:
            raise UserError(f"--ranks {args.ranks!r}: give rank numbers separated by commas, "
                            "e.g. --ranks 0,7") from None
        outside = [r for r in ranks if not 0 <= r < args.world_size]
        if outside:
            raise UserError(f"--ranks: {outside} outside a world of {args.world_size} ranks "
                            f"(0..{args.world_size - 1})")
    else:
        ranks = default_ranks(args.world_size, dims.pp)
    job = job.checked(world_size=dims.world_size, dp_size=dims.dp_size)  # the real run's line
    reports = dry_run_ranks(job, args.world_size, ranks)
    from densetrain.dryrun.advice import format_advice
    from densetrain.dryrun.predict import comm_by_rank, planner_by_rank

    if args.fit_gib <= 0:
        raise UserError(f"--fit-gib {args.fit_gib}: give the GiB a rank may hold (> 0)")
    print(format_report(reports, planner_by_rank(job, args.world_size, reports),
                        comm=comm_by_rank(job, args.world_size, reports)))
    advice = format_advice(job, args.world_size, reports, budget_bytes=args.fit_gib * 2**30)
    if advice:
        print("\n".join(advice))
    return 0


def run_train(args: argparse.Namespace) -> int:
    """Load the job config with the overrides, train, print the summary (`train` checks the
    job's inputs and validates it with the real world size, once, before any work).

    Errors of the input are raised to the one handler in ``cli/main.py``; a run stopped by a
    non-finite loss exits 3.
    """
    from densetrain.config import job_config_to_toml, load_job_config

    config, overrides = split_config_and_overrides(list(getattr(args, "extra", []) or []))
    job = load_job_config(config, overrides)
    if args.print_config:
        print(job_config_to_toml(job))
        return 0
    if args.dry_run or args.world_size or args.ranks:
        return run_dry(job, args)
    if getattr(args, "whole_process", False) and not os.environ.get("LD_PRELOAD"):
        from densetrain.train.host_malloc import restart_with_tuned_allocator

        restart_with_tuned_allocator(job.training.host_allocator, job.training.device, args.argv)
    from densetrain.checkpoint import CheckpointError
    from densetrain.errors import UserError
    from densetrain.train import NonFiniteLossError, train

    started = time.monotonic()
    try:
        summary = train(job)
    except NonFiniteLossError as err:
        print(f"densetrain train: error: {err}", file=sys.stderr)
        return 3
    except UserError:  # a damaged checkpoint (CheckpointDamagedError too): exit 2 in cli/main
        raise
    except CheckpointError as err:  # run dir locked, disk full, unwritable checkpoint
        print(f"densetrain train: error: {err}", file=sys.stderr)
        return 1
    if summary.get("preempted"):  # saved after SIGTERM/SIGINT: 128 + signal, as a shell does
        import signal

        print(f"densetrain train: stopped by {summary['preempted']} after step "
              f"{summary['steps']}; checkpoint {summary['checkpoint']}", file=sys.stderr)
        return 128 + int(signal.Signals[summary["preempted"]])
    if summary.get("already_finished"):  # said in one line by the trainer; nothing to print
        return 0
    if os.environ.get("RANK", "0") == "0":  # torchrun's global rank; the process group is gone
        print("\n".join(ending_lines(summary, time.monotonic() - started)))
    return 0


def ending_lines(summary: dict, wall_seconds: float) -> list[str]:
    """The few lines a finished run ends with: steps, final losses, wall time and where its
    files are. The whole summary (throughput, MFU, goodput, the sample...) stays in
    ``summary.json``; printed in full it buried the result under 30 lines of JSON."""
    from pathlib import Path

    run_dir = Path(summary["run_dir"])
    losses = [f"train loss {summary['final_loss']:.4f}"]
    val = summary.get("final_val_loss", float("nan"))
    losses.append(f"val loss {val:.4f}" if math.isfinite(val)
                  else "val loss - (eval.interval=0)")
    lines = [f"done: {summary['steps']} steps in {_duration(wall_seconds)} | "
             + " | ".join(losses)]
    metrics = run_dir / "metrics.jsonl"
    files = [("checkpoint", summary.get("checkpoint") or "none (checkpoint.enabled=false)"),
             ("metrics", str(metrics) if metrics.is_file() else "none"),
             ("plot", summary.get("plot") or "none (logging.plot=false)"),
             ("summary", str(run_dir / "summary.json"))]
    lines += [f"  {name:<11}{where}" for name, where in files]
    return lines


def _duration(seconds: float) -> str:
    """``4m 31s``, ``1h 02m 05s`` or ``12.3s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
