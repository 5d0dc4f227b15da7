"""Sub-commands of `densetrain data`: train-tokenizer, prepare, inspect, verify (cli/main.py)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from densetrain.cli.argtypes import count
from densetrain.errors import UserError

# The fields of PrepareConfig / MinHashConfig that `data prepare` sets, as its flags, so that a
# refused value is reported by the name the user typed.
_PREPARE_FLAGS = {
    "val_fraction": "--val-fraction", "shard_tokens": "--shard-tokens",
    "on_bad_line": "--on-bad-line", "text_field": "--text-field",
    "shingle_size": "--shingle-size", "num_perm": "--num-perm", "bands": "--bands",
    "threshold": "--threshold",
}
_FIELD_PATTERN = re.compile(r"\b(?:minhash )?(" + "|".join(_PREPARE_FLAGS) + r")\b")


def _as_flags(message: str) -> str:
    """``message`` with every field name of ``_PREPARE_FLAGS`` written as its flag."""
    return _FIELD_PATTERN.sub(lambda m: _PREPARE_FLAGS[m.group(1)], message)


def _text_separator(value: str) -> str:
    """``--text-separator`` with its backslash escapes (``\\n\\n``) decoded; any other character,
    non-ASCII included, stands for itself."""
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as error:
        raise UserError(
            f"--text-separator '{value}': {error.reason}; "
            "write the separator as plain text or with the escapes \\n, \\t, \\r, \\\\, "
            "\\xHH, \\uHHHH or \\N{name} (e.g. '\\n\\n')"
        ) from None


def _train_tokenizer(args: argparse.Namespace) -> int:
    from densetrain.data.sources import ReadStats, expand_inputs, iter_documents
    from densetrain.data.tokenizer import train_tokenizer

    output = Path(args.output)
    if output.is_dir():
        raise UserError(f"--output {output} is a directory; name the tokenizer file to write, "
                        f"e.g. {output / 'tokenizer.json'}")
    if output.exists() and not args.overwrite:  # datasets record the tokenizer they were cut by
        raise UserError(
            f"{output} exists; choose another --output or replace it with --overwrite "
            "(datasets prepared with it record its fingerprint and would no longer match)"
        )
    stats = ReadStats()
    files = expand_inputs(args.inputs)
    documents = iter_documents(
        files,
        text_field=args.text_field,
        on_bad_line=args.on_bad_line,
        text_separator=_text_separator(args.text_separator),
        stats=stats,
    )
    special = tuple(t.strip() for t in args.special_tokens.split(","))
    if len(special) != 3 or not all(special):
        raise UserError(
            f"--special-tokens {args.special_tokens!r}: give three comma-separated names, "
            "BOS,EOS,PAD (e.g. '<|bos|>,<|eos|>,<|pad|>')"
        )
    try:
        tokenizer = train_tokenizer(
            documents,
            args.output,
            vocab_size=args.vocab_size,
            special_tokens=special,
            min_frequency=args.min_frequency,
            show_progress=sys.stderr.isatty(),  # a bar on a terminal, not blank lines in a log
        )
    except UserError as error:  # e.g. an empty corpus: say what reading skipped (binary files)
        note = stats.skipped_note()
        if not note or note.strip() in str(error):
            raise
        raise UserError(f"{error}{note}") from error
    print(f"wrote {tokenizer.path}: byte-level BPE, {tokenizer.vocab_size:,} tokens "
          f"(fingerprint {tokenizer.fingerprint[:12]}) from {stats.documents:,} document"
          f"{'' if stats.documents == 1 else 's'}")
    if tokenizer.vocab_size < args.vocab_size:
        print(f"note: {args.vocab_size:,} tokens were asked; the corpus has no further pair of "
              f"tokens seen --min-frequency {args.min_frequency} times, so training stopped at "
              f"{tokenizer.vocab_size:,} (a larger corpus or a lower --min-frequency gives more)",
              file=sys.stderr)
    skipped = [f"{n:,} {what}" for n, what in (
        (stats.skipped_lines, "unreadable lines"),
        (stats.skipped_binary_files, "binary files"),
        (stats.invalid_utf8_documents, f"documents with invalid UTF-8 ({stats.replaced_bytes:,} "
                                       "bytes replaced)"),
    ) if n]
    if skipped:
        examples = (stats.skipped_examples + stats.skipped_binary_examples)[:3]
        print(f"skipped: {', '.join(skipped)}" + (f"; first: {', '.join(examples)}"
                                                  if examples else ""), file=sys.stderr)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from densetrain.data.dedup import MinHashConfig
    from densetrain.data.prepare import PrepareConfig, prepare_dataset

    cfg = PrepareConfig(
        text_field=args.text_field,
        on_bad_line=args.on_bad_line,
        text_separator=_text_separator(args.text_separator),
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        exact_dedup=args.exact_dedup,
        near_dedup=args.near_dedup,
        minhash=MinHashConfig(
            shingle_size=args.shingle_size,
            num_perm=args.num_perm,
            bands=args.bands,
            threshold=args.threshold,
        ),
        quality_filter=args.quality_filter,
    )
    try:
        cfg.validate()
    except ValueError as error:
        raise UserError(_as_flags(str(error))) from None
    if args.max_shards is not None and args.max_shards < 1:
        raise UserError(f"--max-shards must be >= 1 (stop after that many shards; leave it out "
                        f"to prepare everything), got {args.max_shards}")
    meta = _run_prepare(args, cfg, prepare_dataset)
    if meta is None and args.distributed:
        return 0  # a rank other than 0 of a torchrun job: rank 0 prints the summary
    if meta is None:
        print(f"stopped after {args.max_shards} shards; rerun the same command to continue")
        return 0
    if args.json:
        print(json.dumps({"output": str(args.output), "dtype": meta["dtype"],
                          "splits": {name: {"documents": split["num_documents"],
                                            "tokens": split["num_tokens"],
                                            "shards": len(split["shards"])}
                                     for name, split in meta["splits"].items()},
                          "counts": meta["counts"]}, indent=2))
    else:
        print(prepare_summary(str(args.output), meta))
    return 0


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def prepare_summary(output: str, meta: dict) -> str:
    """The lines `data prepare` prints: each split's documents, tokens and shards, then what
    reading skipped and what the filters removed (all from ``meta.json``)."""
    lines = [f"prepared {output} ({meta['dtype']} tokens):"]
    for name, split in meta["splits"].items():
        lines.append(f"  {name:<6} {_plural(split['num_documents'], 'document'):>18}  "
                     f"{_plural(split['num_tokens'], 'token'):>18}  "
                     f"{_plural(len(split['shards']), 'shard')}")
    counts = meta["counts"]
    read = counts.get("read", {})
    skipped = [_plural(read[key], what) for key, what in (
        ("skipped_lines", "bad line"), ("skipped_binary_files", "binary file"),
    ) if read.get(key)]
    if read.get("invalid_utf8_documents"):  # kept, with U+FFFD for the bad bytes
        skipped.append(f"{_plural(read['replaced_bytes'], 'invalid UTF-8 byte')} (replaced)")
    removed = [_plural(n, reason.replace("_", " "))
               for reason, n in counts.get("removed", {}).items() if n]
    lines.append(f"  read {_plural(read.get('documents', 0), 'document')}"
                 + (f"; skipped {', '.join(skipped)}" if skipped else "")
                 + (f"; removed {', '.join(removed)}" if removed else ""))
    fraction = meta.get("settings", {}).get("val_fraction", 0.0)
    if fraction and not meta["splits"].get("val", {}).get("num_documents"):
        lines.append(f"  note: --val-fraction {fraction} drew no document for validation")
    return "\n".join(lines)


def _run_prepare(args: argparse.Namespace, cfg, prepare_dataset) -> dict | None:
    """The single-process path (the default), local worker processes, or a torchrun rank."""
    from densetrain.data.scaleout import prepare_dataset_distributed, prepare_dataset_parallel

    if (args.workers != 1 or args.distributed) and args.max_shards:
        raise UserError("--max-shards applies to the single-process prepare; with --workers or "
                        "--distributed an interrupted run resumes from its completed tasks")
    if args.workers != 1 and args.distributed:
        raise UserError("give --workers N (local processes) or --distributed (one worker per "
                        "torchrun rank), not both")
    common = dict(tokenizer=args.tokenizer, cfg=cfg, overwrite=args.overwrite)
    if args.distributed:
        return prepare_dataset_distributed(args.inputs, args.output, **common)
    if args.workers != 1:
        return prepare_dataset_parallel(args.inputs, args.output, workers=args.workers, **common)
    return prepare_dataset(args.inputs, args.output, max_shards=args.max_shards or 0,
                           progress=sys.stderr.isatty(), **common)  # no bar lines in a log


def _inspect(args: argparse.Namespace) -> int:
    from densetrain.data.inspect import format_report, inspect_dataset

    report = inspect_dataset(args.path, split=args.split, sample_tokens=args.sample_tokens)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from densetrain.data.shards import verify_dataset

    report = verify_dataset(args.path)
    rate = report["bytes"] / max(report["seconds"], 1e-9) / 1e6
    print(f"{args.path}: {report['shards']} shards, {report['bytes']:,} bytes verified in "
          f"{report['seconds']:.2f} s ({rate:.0f} MB/s); tokenizer matches")
    return 0


def _add_reading_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="text files, directories, globs, JSONL, Parquet")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column")
    parser.add_argument(
        "--on-bad-line",
        choices=("error", "skip"),
        default="error",
        help="a bad record (a malformed JSONL line, a missing or non-string text field, a lone "
        "surrogate, a null Parquet row): fail naming file:line, or skip and count",
    )
    parser.add_argument(
        "--text-separator",
        default="",
        help="split text files into documents at this string (e.g. '\\n\\n'); default: one "
        "document per file",
    )


def _register_prepare(data_sub: argparse._SubParsersAction) -> None:
    prep = data_sub.add_parser("prepare", help="raw text -> token shards + index + metadata")
    _add_reading_args(prep)
    prep.add_argument("--output", "-o", required=True, help="output dataset directory")
    prep.add_argument("--tokenizer", required=True, help="tokenizer.json or SentencePiece .model")
    prep.add_argument("--val-fraction", type=float, default=0.0,
                      help="share of documents held out as the val split, by document hash "
                      "(default 0)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24,
                      help="tokens per shard file (default %(default)s)")
    prep.add_argument("--exact-dedup", action="store_true", help="drop exact duplicates")
    prep.add_argument("--near-dedup", action="store_true", help="drop MinHash near-duplicates")
    prep.add_argument("--shingle-size", type=int, default=5, help="MinHash word shingle size")
    prep.add_argument("--num-perm", type=int, default=128, help="MinHash permutations")
    prep.add_argument("--bands", type=int, default=16, help="LSH bands (divides --num-perm)")
    prep.add_argument("--threshold", type=float, default=0.8, help="near-duplicate Jaccard")
    prep.add_argument("--quality-filter", action="store_true", help="Gopher quality heuristics")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace the prepared dataset at --output (only a densetrain "
                      "dataset; the old one stays until the new one is complete)")
    prep.add_argument("--json", action="store_true",
                      help="print the splits and counts as JSON instead of the summary")
    prep.add_argument("--max-shards", type=int, default=None,
                      help="stop after N >= 1 shards (rerun to continue)")
    prep.add_argument(
        "--workers",
        type=int,
        default=1,
        help="local worker processes (0: one per core); same shards as 1 (docs/data.md)",
    )
    prep.add_argument(
        "--distributed",
        action="store_true",
        help="run as one worker per rank of a torchrun job (multi-node, e.g. srun torchrun)",
    )
    prep.set_defaults(func=_prepare)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `densetrain data {train-tokenizer,prepare,inspect,verify}`."""
    data = subparsers.add_parser("data", help="tokenizers and dataset preparation")
    data_sub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")

    def _help(_args: argparse.Namespace) -> int:
        data.print_help()
        return 2

    data.set_defaults(func=_help)

    tok = data_sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json")
    _add_reading_args(tok)
    tok.add_argument("--output", "-o", required=True, help="path of the tokenizer.json to write")
    tok.add_argument("--vocab-size", type=int, required=True,
                     help="ids of the tokenizer, special tokens included")
    tok.add_argument("--special-tokens", default="<|bos|>,<|eos|>,<|pad|>", help="BOS,EOS,PAD")
    tok.add_argument("--min-frequency", type=int, default=2,
                     help="fewest occurrences of a pair to merge (default 2)")
    tok.add_argument("--overwrite", action="store_true",
                     help="replace an existing file at --output")
    tok.set_defaults(func=_train_tokenizer)

    _register_prepare(data_sub)

    insp = data_sub.add_parser("inspect", help="counts, token statistics, a decoded sample")
    insp.add_argument("path", help="prepared dataset directory")
    insp.add_argument("--split", default="train", help="train or val (default train)")
    insp.add_argument("--sample-tokens", type=count(0, "0: none shown"), default=200,
                      help="tokens of the decoded sample (default 200; 0: none)")
    insp.add_argument("--json", action="store_true", help="print JSON")
    insp.set_defaults(func=_inspect)

    verify = data_sub.add_parser(
        "verify", help="hash every shard against the checksums in meta.json (full check)"
    )
    verify.add_argument("path", help="prepared dataset directory")
    verify.set_defaults(func=_verify)
