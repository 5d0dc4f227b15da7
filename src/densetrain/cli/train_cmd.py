"""`densetrain train [CONFIG] [--section.field=value ...]`: run a training job.

Without CONFIG the embedded default runs: a tiny LLaMA-style model on the Python standard
library sources with a BPE tokenizer trained on them; no download and no setup. Overrides use
dotted paths, e.g. ``--training.steps=50 --model.num_layers=4 --logging.run_dir=runs/x``.

Speed on CPU: the allocator matters (large per-step tensors are otherwise mmap'ed and faulted in
again each step). Preload tcmalloc (``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4``) or
set ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0``; set the thread count with ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` sub-command."""
    parser = subparsers.add_parser(
        "train",
        help="train a model (no arguments: the embedded tiny default)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "config", nargs="?", default=None, help="job TOML file (default: the embedded default)"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.set_defaults(func=run_train, accepts_extra=True)


def run_train(args: argparse.Namespace) -> int:
    """Load the job config with the overrides, train, print the summary."""
    from densetrain.config import job_config_to_toml, load_job_config

    overrides = list(getattr(args, "extra", []) or [])
    try:
        job = load_job_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"densetrain train: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(job_config_to_toml(job))
        return 0
    from densetrain.checkpoint import CheckpointError
    from densetrain.train import NonFiniteLossError, train

    try:
        summary = train(job)
    except NonFiniteLossError as err:
        print(f"densetrain train: {err}", file=sys.stderr)
        return 3
    except ValueError as err:
        print(f"densetrain train: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # run dir locked, disk full, unwritable checkpoint
        print(f"densetrain train: {err}", file=sys.stderr)
        return 1
    if summary.get("preempted"):  # saved after SIGTERM/SIGINT: 128 + signal, as a shell does
        import signal

        print(f"densetrain train: stopped by {summary['preempted']} after step "
              f"{summary['steps']}; checkpoint {summary['checkpoint']}", file=sys.stderr)
        return 128 + int(signal.Signals[summary["preempted"]])
    if os.environ.get("RANK", "0") == "0":  # torchrun's global rank; the process group is gone
        printable = {k: v for k, v in summary.items() if k != "sample"}
        print(json.dumps(printable, indent=2))
    return 0
