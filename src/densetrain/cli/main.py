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

_COMMAND_MODULES = {
    "densetrain.cli.train_cmd": ("train",),
    "densetrain.cli.data_cmd": ("data",),  # data train-tokenizer | prepare | inspect
    "densetrain.cli.models_cmd": ("convert", "model-info"),
    "densetrain.cli.scaling_cmd": ("scaling",),  # scaling sweep | fit | optimal
    "densetrain.cli.plan_cmd": ("plan",),
    "densetrain.cli.eval_cmd": ("eval", "generate"),  # eval perplexity | tasks, generate
}


def _modules_for(argv: list[str]) -> list[str]:
    """The command modules to register: only the named command's when argv names one (so that
    one command does not pay for importing the others), else all (for help)."""
    words = [a for a in argv if not a.startswith("-")]
    named = [m for m, commands in _COMMAND_MODULES.items() if words and words[0] in commands]
    return named or list(_COMMAND_MODULES)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with the sub-commands of ``argv`` (default: all) registered."""
    parser = argparse.ArgumentParser(
        prog="densetrain",
        description="Pretrain dense decoder-only language models, from one CPU to many GPUs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Registering reads configs (pure Python) but must not import torch: `--help` and `plan`
    # never need it. The torch model is imported on first use.
    from densetrain.planner.model_imports import defer_models_init

    defer_models_init()
    for name in _modules_for(argv) if argv is not None else _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``densetrain`` console script."""
    parser = build_parser(sys.argv[1:] if argv is None else argv)
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
