"""`densetrain` command line: one sub-command family per module, each a thin library wrapper.

Every module listed in ``_COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func`` (a callable taking the parsed ``argparse.Namespace`` and returning
an exit code) on each sub-parser. Heavy imports happen inside the command functions so that
``densetrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = (
    "densetrain.cli.train_cmd",  # train
    "densetrain.cli.data_cmd",  # data train-tokenizer | prepare | inspect
    "densetrain.cli.models_cmd",  # convert, model-info
    "densetrain.cli.scaling_cmd",  # scaling sweep | fit | optimal
    "densetrain.cli.plan_cmd",  # plan
    "densetrain.cli.eval_cmd",  # eval perplexity | tasks, generate
    "densetrain.cli.goodput_cmd",  # goodput
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="densetrain",
        description="Pretrain dense decoder-only language models, from one CPU to many GPUs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``densetrain`` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
