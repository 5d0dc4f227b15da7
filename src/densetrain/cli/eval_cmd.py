"""Sub-commands `densetrain eval perplexity | tasks | harness` and `densetrain generate`.

MODEL is a densetrain model directory, a Hugging Face checkpoint directory or a training
checkpoint (``step-N``, a checkpoint directory, or a run directory); the tokenizer is
``--tokenizer`` or the one stored beside the model (see ``densetrain.eval.loading``). Results
print as a table, or as JSON with ``--json``; ``--output FILE`` also writes the JSON (atomically).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from densetrain.cli.argtypes import count
from densetrain.config.sections import SAMPLE_TEMPERATURE, SAMPLE_TOP_K, SAMPLE_TOP_P
from densetrain.errors import MissingDependencyError, UserError

_DTYPES = ("float32", "bfloat16", "float16")


def _check_window(args: argparse.Namespace, model) -> None:
    """``--seq-len`` and ``--stride`` against the loaded model, named as flags."""
    cfg = model.config
    window = args.seq_len or cfg.max_seq_len
    if cfg.position_embedding == "learned" and window > cfg.max_seq_len:
        raise UserError(
            f"--seq-len {args.seq_len} exceeds max_seq_len {cfg.max_seq_len} of {args.model}, a "
            f"model with learned positions; give --seq-len {cfg.max_seq_len} or less (0 = "
            "its max_seq_len)"
        )
    if args.stride > window:
        what = "--seq-len" if args.seq_len else "the model's max_seq_len, as --seq-len is 0"
        raise UserError(f"--stride {args.stride} exceeds the window of {window} tokens ({what});"
                        f" give --stride {window} or less (0 = the window)")


def _load(args: argparse.Namespace):
    import torch

    from densetrain.eval.loading import load_for_eval

    dtype = getattr(torch, args.dtype) if args.dtype else None
    return load_for_eval(args.model, tokenizer=args.tokenizer, device=args.device, dtype=dtype)


def _emit(args: argparse.Namespace, record: dict, lines: list[str]) -> None:
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError as error:  # e.g. a full disk: no half-written file left, the path named
            tmp.unlink(missing_ok=True)
            raise OSError(error.errno, error.strerror, str(path)) from error
    print(json.dumps(record, indent=2) if args.json else "\n".join(lines))


def _perplexity(args: argparse.Namespace) -> int:
    from densetrain.eval.perplexity import PerplexityConfig, dataset_perplexity, file_perplexity

    if bool(args.text) == bool(args.dataset):
        raise UserError("give exactly one of --text PATH... or --dataset DIR")
    if args.dataset and not Path(args.dataset).is_dir():
        what = "is a file" if Path(args.dataset).exists() else "does not exist"
        raise UserError(f"--dataset {args.dataset} {what}; it takes a dataset directory written "
                        "by `densetrain data prepare` (score text or JSONL files with --text)")
    model, tokenizer = _load(args)
    _check_window(args, model)
    cfg = PerplexityConfig(
        seq_len=args.seq_len, stride=args.stride, batch_size=args.batch_size,
        prefix=args.prefix, max_documents=args.max_documents,
    )
    if args.text:
        result = file_perplexity(model, tokenizer, args.text, cfg, text_field=args.text_field)
        source = {"text": args.text}
    else:
        result = dataset_perplexity(model, args.dataset, cfg, split=args.split, tokenizer=tokenizer)
        source = {"dataset": args.dataset, "split": args.split}
    if not math.isfinite(result.loss):
        raise UserError(
            f"{args.model}: the loss is {result.loss} (non-finite); the model's outputs overflow "
            f"or are not numbers{' in ' + args.dtype if args.dtype else ''}: try --dtype float32"
        )
    record = {"model": str(args.model), **source, **result.as_dict()}
    lines = [
        f"{args.model}: {result.documents} documents, {result.tokens:,} tokens, "
        f"{result.bytes:,} bytes",
        f"  loss {result.loss:.4f} nats/token   perplexity {result.perplexity:.3f}",
        f"  bits/byte {result.bits_per_byte:.4f}   word perplexity {result.word_perplexity:.3f}",
    ]
    _emit(args, record, lines)
    return 0


def _tasks(args: argparse.Namespace) -> int:
    from densetrain.eval.harness import evaluate_task
    from densetrain.eval.tasks import load_task

    model, tokenizer = _load(args)
    results, lines = [], []
    for spec in args.task:
        task = load_task(spec, fewshot_path=args.fewshot_file)
        result = evaluate_task(
            model, tokenizer, task, shots=args.shots, seed=args.seed, limit=args.limit,
            batch_size=args.batch_size, prefix=args.prefix, keep_samples=args.log_samples,
        )
        results.append(result.as_dict(with_samples=args.log_samples))
        chance = sum(1 / len(e.choices) for e in task.examples[: result.num_examples])
        lines.append(
            f"{task.name} ({result.num_examples} examples, {args.shots}-shot, chance "
            f"{chance / result.num_examples:.3f}): acc {result.acc:.4f} ± {result.acc_stderr:.4f}"
            f"   acc_norm {result.acc_norm:.4f} ± {result.acc_norm_stderr:.4f}"
        )
    _emit(args, {"model": str(args.model), "results": results}, lines)
    return 0


def _harness(args: argparse.Namespace) -> int:
    import importlib.util

    from densetrain.eval.lm_eval_adapter import harness_task_manager, run_lm_eval, unknown_tasks

    # Every check before the model loads: the harness, the include path and the task names.
    if importlib.util.find_spec("lm_eval") is None:
        raise MissingDependencyError(
            "lm-evaluation-harness is not installed; `pip install lm-eval`")
    include = args.include_path
    if include is not None and not Path(include).is_dir():
        what = "is a file" if Path(include).exists() else "does not exist"
        raise UserError(f"--include-path {include} {what}; it takes a directory of "
                        "lm-evaluation-harness task YAML files")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError(f"--tasks {args.tasks!r} names no task; give comma-separated harness "
                        "task names")
    manager = harness_task_manager(include)
    missing = unknown_tasks(manager, tasks)
    if missing:
        where = (f"nor a task defined under --include-path {include}" if include is not None
                 else "(a task of your own: define it in YAML and give --include-path DIR)")
        raise UserError(f"--tasks: {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not an lm-evaluation-harness "
                        f"task {where}")
    model, tokenizer = _load(args)
    results = run_lm_eval(
        model, tokenizer, tasks, num_fewshot=args.shots, limit=args.limit or None,
        task_manager=manager, include_path=include, batch_size=args.batch_size,
        prefix=args.prefix,
    )
    _emit(args, {"model": str(args.model), "results": results},
          [json.dumps(results, indent=2, default=str)])
    return 0


def _check_generate_args(args: argparse.Namespace) -> None:
    """The sampling flags' errors before the model loads: values out of range, and flags that
    greedy decoding (``--temperature 0``) would silently ignore."""
    from densetrain.generate.sampling import check_sampling

    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be a positive integer, or 0 for no limit, "
                        f"got {args.top_k}")
    check_sampling(args.temperature, args.top_k or None, args.top_p,
                   names=("--temperature", "--top-k", "--top-p"))
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be a positive integer, got {args.num_samples}")
    if args.temperature == 0:
        ignored = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p))
                   if value is not None]
        if args.num_samples > 1:
            ignored.append(f"--num-samples {args.num_samples}")
        if ignored:
            raise UserError(
                f"{' and '.join(ignored)} {'needs' if len(ignored) == 1 else 'need'} sampling: "
                f"give --temperature > 0 (e.g. {SAMPLE_TEMPERATURE}); "
                "at --temperature 0 decoding is greedy, one and the same completion"
            )


def _sampling_limits(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """``(top_k, top_p)`` for `generate`: the flags given, else the defaults (top-k
    `SAMPLE_TOP_K`, top-p `SAMPLE_TOP_P`) when sampling; ``--top-k 0`` and ``--top-p 1`` lift
    a limit. Greedy decoding reads neither."""
    if args.temperature == 0:
        return None, None
    top_k = SAMPLE_TOP_K if args.top_k is None else args.top_k
    top_p = SAMPLE_TOP_P if args.top_p is None else args.top_p
    return top_k or None, top_p if top_p < 1 else None


def _generate(args: argparse.Namespace) -> int:
    import torch

    from densetrain.generate import generate

    _check_generate_args(args)
    model, tokenizer = _load(args)
    device = next(model.parameters()).device
    ids = tokenizer.encode(args.prompt) or [tokenizer.eos_id]
    cfg = model.config
    if cfg.position_embedding == "learned" and len(ids) + args.max_new_tokens > cfg.max_seq_len:
        room = cfg.max_seq_len - len(ids)
        raise UserError(
            f"the prompt's {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} exceed "
            f"max_seq_len {cfg.max_seq_len} of {args.model}, a model with learned positions; "
            + (f"give --max-new-tokens {room} or less" if room > 0
               else "shorten the prompt")
        )
    prompt_BS = torch.tensor([ids] * args.num_samples, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    top_k, top_p = _sampling_limits(args)
    out_BT = generate(
        model, prompt_BS, args.max_new_tokens, temperature=args.temperature,
        top_k=top_k, top_p=top_p,
        eos_token_id=None if args.ignore_eos else tokenizer.eos_id, generator=generator,
    )
    completions = []
    for row in out_BT.tolist():
        new = row[len(ids):]
        if not args.ignore_eos and tokenizer.eos_id in new:
            new = new[: new.index(tokenizer.eos_id)]
        completions.append(tokenizer.decode(new))
    record = {"model": str(args.model), "prompt": args.prompt, "completions": completions}
    lines = [f"{args.prompt}{c}" + ("\n" + "-" * 40 if len(completions) > 1 else "")
             for c in completions]
    _emit(args, record, lines)
    return 0


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model dir, Hugging Face dir, or training checkpoint/run")
    parser.add_argument("--tokenizer", help="tokenizer.json / .model (default: beside MODEL)")
    parser.add_argument("--device", default="auto", help="auto (first GPU, else CPU), cpu, cuda")
    parser.add_argument("--dtype", choices=_DTYPES, help="cast the weights (default: as stored)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--output", "-o", help="also write the JSON record to this file")


def _add_scoring_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=count(1), default=8, help="rows per forward pass")
    parser.add_argument("--prefix", choices=("eos", "bos"), default="eos",
                        help="token placed before each document / empty context")


def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser("eval", help="perplexity / bits per byte and few-shot tasks")
    ev_sub = ev.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND")

    def _help(_args: argparse.Namespace) -> int:
        ev.print_help()
        return 2

    ev.set_defaults(func=_help)

    ppl = ev_sub.add_parser("perplexity", help="loss, perplexity and bits per byte")
    _add_model_args(ppl)
    _add_scoring_args(ppl)
    ppl.add_argument("--text", nargs="+", help="text/JSONL/Parquet files, directories, globs")
    ppl.add_argument("--text-field", default="text", help="JSONL field / Parquet column")
    ppl.add_argument("--dataset", help="prepared dataset directory (densetrain data prepare)")
    ppl.add_argument("--split", default="val", help="split of --dataset (default val)")
    ppl.add_argument("--seq-len", type=count(0, "0 = the model's max_seq_len"), default=0,
                     help="window; 0 = model max_seq_len")
    ppl.add_argument("--stride", type=count(0, "0 = --seq-len"), default=0,
                     help="new tokens per window; 0 = seq-len")
    ppl.add_argument("--max-documents", type=count(0, "0 = all"), default=0, help="0 = all")
    ppl.set_defaults(func=_perplexity)

    tasks = ev_sub.add_parser("tasks", help="multiple-choice few-shot accuracy")
    _add_model_args(tasks)
    _add_scoring_args(tasks)
    tasks.add_argument("--task", action="append", required=True,
                       help="built-in name (stdlib-next-line) or JSONL file; repeatable")
    tasks.add_argument("--shots", type=count(0), default=0,
                       help="solved examples in each prompt")
    tasks.add_argument("--fewshot-file", help="JSONL file of few-shot examples")
    tasks.add_argument("--seed", type=int, default=1234, help="seed of the few-shot draw")
    tasks.add_argument("--limit", type=count(0, "0 = all"), default=0,
                       help="first N examples; 0 = all")
    tasks.add_argument("--log-samples", action="store_true",
                       help="include per-example log-likelihoods in the JSON")
    tasks.set_defaults(func=_tasks)

    harness = ev_sub.add_parser("harness", help="EleutherAI lm-evaluation-harness tasks")
    _add_model_args(harness)
    _add_scoring_args(harness)
    harness.add_argument("--tasks", required=True, help="comma-separated harness task names")
    harness.add_argument("--include-path", metavar="DIR",
                         help="directory of your own task YAML files (local tasks)")
    harness.add_argument("--shots", type=count(0), default=None, help="num_fewshot")
    harness.add_argument("--limit", type=count(0, "0 = all"), default=0,
                         help="examples per task; 0 = all")
    harness.set_defaults(func=_harness)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `densetrain eval {perplexity,tasks,harness}` and `densetrain generate`."""
    _register_eval(subparsers)
    gen = subparsers.add_parser("generate", help="continue a prompt (KV-cached decoding)")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=count(0), default=64,
                     help="tokens to generate after the prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=SAMPLE_TEMPERATURE,
                     help=f"softmax temperature (default {SAMPLE_TEMPERATURE}); 0 = greedy")
    gen.add_argument("--top-k", type=int, default=None,
                     help=f"sample among the k likeliest tokens (default {SAMPLE_TOP_K}; "
                     "0 = no limit; needs --temperature > 0)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="sample from the smallest set of tokens of probability p (nucleus; "
                     f"default {SAMPLE_TOP_P}; 1 = no limit; needs --temperature > 0)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    gen.add_argument("--num-samples", type=int, default=1, help="completions of the prompt")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    gen.set_defaults(func=_generate)
