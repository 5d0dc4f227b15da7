"""`densetrain export SOURCE --to-hf DIR`: a training run, checkpoint or model to Hugging Face.

SOURCE is a run directory (its latest complete checkpoint), a checkpoint directory, one
``step-N`` checkpoint (saved by any layout: one process, FSDP, TP, PP) or a densetrain model
directory. DIR receives config.json (with BOS/EOS/PAD ids), generation_config.json, safetensors
weights and the run's tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json),
so that ``AutoTokenizer.from_pretrained(DIR)`` and ``AutoModelForCausalLM.from_pretrained(DIR)``
need nothing else. Tensors stream one at a time from the checkpoint to the files, so exporting
needs no more memory than the largest tensor (q, k and v together for fused projections).

``densetrain convert --to-hf SOURCE --out DIR`` is the same command under its older name.
"""

from __future__ import annotations

import argparse

_DTYPES = ("float32", "bfloat16", "float16")


def run_export(args: argparse.Namespace, source: str, out: str, command: str) -> int:
    """Export ``source`` to ``out`` with the options in ``args``; print a one-line summary."""
    import torch

    from densetrain.export import export_to_hf

    summary = export_to_hf(  # errors of the input go to the CLI's one boundary (cli/main.py)
        source, out, hf_family=args.family,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer,
        max_shard_bytes=int(args.max_shard_gb * 10**9), overwrite=args.overwrite,
    )
    print(f"exported {summary['source']} -> {out} (Hugging Face {summary['family']}, "
          f"{summary['parameters']:,} parameters, {summary['dtype']})")
    return 0


def _shard_gb(text: str) -> float:
    """``--max-shard-gb``: a finite number of GB above 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of GB above 0 (e.g. 5), got {text!r}")
    return value


def add_export_options(parser: argparse.ArgumentParser) -> None:
    """The options shared by ``export --to-hf`` and ``convert --to-hf``."""
    parser.add_argument(
        "--family", default=None,
        help="Hugging Face model_type to export as (default: the config's extra.hf_family)",
    )
    parser.add_argument("--dtype", choices=_DTYPES, default=None,
                        help="cast weights (default: keep)")
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="tokenizer.json to ship (default: the one the run trained with, "
                             "or the tokenizer.json beside a model directory)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="write the weights and configs only")
    parser.add_argument("--max-shard-gb", type=_shard_gb, default=5.0,
                        help="shard the safetensors past this size (default 5)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output")


def _export(args: argparse.Namespace) -> int:
    return run_export(args, args.source, args.to_hf, "export")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``export`` sub-command."""
    parser = subparsers.add_parser(
        "export",
        help="export a training run, checkpoint or model directory to Hugging Face",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE",
                        help="run directory, checkpoint directory, step-N checkpoint or "
                             "densetrain model directory")
    parser.add_argument("--to-hf", metavar="DIR", required=True,
                        help="Hugging Face directory to write (atomically)")
    add_export_options(parser)
    parser.set_defaults(func=_export)
