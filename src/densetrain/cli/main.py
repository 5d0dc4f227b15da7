"""`densetrain` command line: one sub-command family per module, each a thin library wrapper.

Every module listed in ``_COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func`` (a callable taking the parsed ``argparse.Namespace`` and returning
an exit code) on each sub-parser. Heavy imports happen inside the command functions so that
``densetrain --help`` stays fast.

Errors: `main` is the one place where a command's exceptions are caught. An error about the
input (``densetrain.errors.is_user_error``: a ``UserError``, or an ``OSError`` naming a path)
prints one line ``densetrain <command>: error: <message>`` and exits 2; a lost peer rank
(``densetrain.errors.RankFailure``: a failed collective, named from the ranks' heartbeats)
prints one line naming the lost rank and exits `EXIT_RANK_FAILURE`; any other exception is a
bug: it prints its traceback and a line asking for a bug report, and exits 1. ``--debug``
(anywhere on the command line) prints the traceback of an input error as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

DEBUG_FLAG = "--debug"
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1
EXIT_RANK_FAILURE = 4  # another rank died or stopped (docs/reliability.md, "Lost ranks")
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader left

_COMMAND_MODULES = {
    "densetrain.cli.train_cmd": ("train",),
    "densetrain.cli.data_cmd": ("data",),  # data train-tokenizer | prepare | inspect | verify
    "densetrain.cli.models_cmd": ("convert", "model-info", "presets"),
    "densetrain.cli.export_cmd": ("export",),
    "densetrain.cli.scaling_cmd": ("scaling",),  # scaling sweep | fit | optimal
    "densetrain.cli.plan_cmd": ("plan",),
    "densetrain.cli.eval_cmd": ("eval", "generate"),  # eval perplexity | tasks, generate
    "densetrain.cli.goodput_cmd": ("goodput",),
    "densetrain.cli.checkpoints_cmd": ("checkpoints",),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("densetrain")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``, reading the package metadata only when asked (importlib.metadata costs
    about 70 ms of every command's start-up otherwise)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"densetrain {_version()}")  # on stdout, as argparse's own version action
        parser.exit()


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
    parser.add_argument(
        DEBUG_FLAG, action="store_true", help="show the full traceback of an error (anywhere)"
    )
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Registering reads configs (pure Python) but must not import torch: `--help` and `plan`
    # never need it. The torch model is imported on first use.
    from densetrain.planner.model_imports import defer_models_init

    defer_models_init()
    for name in _modules_for(argv) if argv is not None else _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


# Options other training tools use for what a densetrain command calls differently
# (torchrun / Megatron-LM's GPU counts); suggested when the command has the target option.
_OPTION_ALIASES = {
    "--gpus": "--devices", "--num-gpus": "--devices", "--ngpus": "--devices",
    "--world-size": "--devices", "--nproc-per-node": "--devices",
    "--seq-length": "--seq-len", "--sequence-length": "--seq-len", "--max-seq-len": "--seq-len",
    "--global-batch-size": "--global-batch", "--batch-size": "--global-batch",
}


def _command_parser(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost sub-command parser that ``args`` was parsed by (``parser`` if none)."""
    for word in _command_name(args).split() if getattr(args, "command", None) else ():
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            break
        parser = actions[0].choices[word]
    return parser


def _unrecognized_message(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``unrecognized arguments: ...`` with, for each unknown option, the command's own
    option it most likely means (argparse's message names none)."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extra:
        name = word.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        alias = _OPTION_ALIASES.get(name)
        guess = [alias] if alias in known else difflib.get_close_matches(name, known, 1, 0.75)
        if guess:
            hints.append(f"{name}: did you mean {guess[0]}?")
    message = f"unrecognized arguments: {' '.join(extra)}"
    if hints:
        message += " (" + "; ".join(hints) + ")"
    return message + f"; `{parser.prog} --help` lists the options"


def _command_name(args: argparse.Namespace) -> str:
    """``data prepare``, ``eval perplexity``, ``train``: the words naming the command run."""
    words = [getattr(args, "command", None)]
    words += [getattr(args, f"{words[0]}_command", None)] if words[0] else []
    return " ".join(w for w in words if w) or "densetrain"


def _as_rank_failure(error: BaseException) -> BaseException:
    """A backend's raw error from a collective outside the training step (a fault check, a
    checkpoint save) as the `CollectiveError` naming the lost rank; else ``error`` itself.
    Only where this process ran a multi-rank job (its heartbeat still runs), and without
    importing torch when the command never did."""
    if "torch.distributed" not in sys.modules or not isinstance(error, RuntimeError):
        return error
    from densetrain.parallel.distributed import (
        CollectiveError,
        collective_error,
        is_collective_failure,
    )
    from densetrain.parallel.heartbeat import current_heartbeat

    if isinstance(error, CollectiveError) or current_heartbeat() is None \
            or not is_collective_failure(error):
        return error
    converted = collective_error(error)
    converted.__cause__ = error
    return converted


def report_error(error: BaseException, command: str, *, debug: bool) -> int:
    """Print ``error`` for the user (one line, or the traceback with ``debug``); the exit code."""
    from densetrain.errors import RankFailure, describe_error, is_user_error

    error = _as_rank_failure(error)
    user_error = is_user_error(error)
    if debug or not (user_error or isinstance(error, RankFailure)):
        traceback.print_exception(type(error), error, error.__traceback__)
    if isinstance(error, RankFailure):
        print(f"densetrain {command}: error: {describe_error(error)}", file=sys.stderr,
              flush=True)
        return EXIT_RANK_FAILURE
    message = describe_error(error)
    if not user_error:
        message = (f"internal error {type(error).__name__}: {message}\n"
                   f"densetrain {command}: this is a bug in densetrain, not in your input; "
                   f"please report it with the traceback above")
    print(f"densetrain {command}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR if user_error else EXIT_INTERNAL_ERROR


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``densetrain`` console script."""
    whole_process = argv is None  # the console script, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        # Reported by the command's own parser: its usage line, not the top level's.
        command_parser = _command_parser(parser, args)
        command_parser.error(_unrecognized_message(command_parser, extra))
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    args.debug = debug
    args.whole_process = whole_process
    args.argv = argv + ([DEBUG_FLAG] if debug else [])
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so that a reader gone early is met below, not at exit
        return code
    except KeyboardInterrupt:
        print(f"densetrain {_command_name(args)}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BrokenPipeError:
        # The reader went away (``densetrain data inspect DS | head``): stop quietly, as Unix
        # tools do, with the shell's code for SIGPIPE. stdout points at /dev/null so that the
        # interpreter's final flush of the buffered output cannot raise again.
        if whole_process:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except BaseException as error:  # the one boundary where every command's errors are reported
        from densetrain.errors import unwrap_error

        return report_error(unwrap_error(error), _command_name(args), debug=debug)


def entry() -> None:
    """The ``densetrain`` program: `main`, then exit with its status. After a lost peer (status
    `EXIT_RANK_FAILURE`) the process ends at once, its one line flushed, without the
    interpreter's finalisation (threads, process-group objects, atexit work of libraries): the
    launcher is restarting the group, and a SIGTERM it sends meanwhile would otherwise turn the
    documented status into death by signal."""
    code = main()
    if code == EXIT_RANK_FAILURE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
