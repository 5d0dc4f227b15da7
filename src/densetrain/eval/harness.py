"""Few-shot multiple-choice evaluation by log-likelihood (GPT-3, Brown et al. 2020, §2).

For each example a prompt is built from ``k`` solved examples drawn (seeded, per example) from
the task's few-shot pool, then the example's context; every choice is scored by the summed
log-probability of its tokens as a continuation of that prompt. ``acc`` takes the choice with
the highest sum; ``acc_norm`` divides each sum by the continuation's length in characters first
(lm-evaluation-harness's ``acc_norm``), which removes the bias toward short answers. The standard
errors are those of a mean of 0/1 outcomes (sample standard deviation / sqrt(n)).

Tokenization follows lm-evaluation-harness: trailing whitespace of the context moves into the
continuation; context and continuation are encoded together and split where the context's own
encoding ends; an empty context is replaced by the prefix token; over-long inputs lose tokens
on the left.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from densetrain.errors import UserError
from densetrain.eval.scoring import LogLikelihoodScorer, Segment, SegmentScore
from densetrain.eval.tasks import Example, MultipleChoiceTask


@dataclass(kw_only=True)
class TaskResult:
    """Accuracy figures of one task at ``shots`` shots (and per-example records if asked)."""

    task: str
    shots: int
    seed: int
    num_examples: int
    acc: float
    acc_stderr: float
    acc_norm: float
    acc_norm_stderr: float
    fingerprint: str
    samples: list[dict] = field(default_factory=list)

    def as_dict(self, *, with_samples: bool = False) -> dict:
        """Plain dict for JSON (samples only when asked)."""
        out = {k: v for k, v in vars(self).items() if k != "samples"}
        if with_samples:
            out["samples"] = self.samples
        return out


def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation), encoded together as lm-evaluation-harness does."""
    stripped = context.rstrip()
    moved = len(context) - len(stripped)
    if moved:
        context, continuation = stripped, context[len(stripped):] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return whole[: len(context_ids)], whole[len(context_ids):]


def pair_segment(
    context_ids: Sequence[int], continuation_ids: Sequence[int], *, prefix_id: int, max_len: int
) -> Segment:
    """The segment scoring ``continuation_ids`` after ``context_ids`` (left-truncated)."""
    if not continuation_ids:
        raise ValueError("a continuation must have at least one token")
    if len(continuation_ids) > max_len:
        raise ValueError(
            f"continuation of {len(continuation_ids)} tokens does not fit the {max_len}-token "
            "window"
        )
    context = list(context_ids) or [int(prefix_id)]
    tokens = [*context, *continuation_ids][-(max_len + 1):]
    return Segment(tokens=tokens, num_scored=len(continuation_ids))


def loglikelihoods(
    scorer: LogLikelihoodScorer,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    prefix_id: int,
) -> list[SegmentScore]:
    """Score (context, continuation) string pairs; one ``SegmentScore`` per pair, in order."""
    segments = []
    for context, continuation in pairs:
        context_ids, continuation_ids = split_pair(tokenizer, context, continuation)
        segments.append(
            pair_segment(context_ids, continuation_ids, prefix_id=prefix_id,
                         max_len=scorer.max_len)
        )
    return scorer.score_all(segments)


def fewshot_prompt(task: MultipleChoiceTask, index: int, shots: int, seed: int) -> str:
    """The prompt of example ``index``: description, ``shots`` solved examples, its context.

    The shots are drawn with ``random.Random(f"{seed}:{index}")``, so an example's prompt does
    not depend on which other examples are evaluated.
    """
    example = task.examples[index]
    parts = []
    if shots:
        own_pool = task.fewshot_examples is None
        pool = task.examples if own_pool else task.fewshot_examples
        candidates = [i for i in range(len(pool)) if not (own_pool and i == index)]
        if shots > len(candidates):
            raise UserError(
                f"task {task.name!r}: {shots} shots requested but the few-shot pool holds "
                f"{len(candidates)} examples"
            )
        rng = random.Random(f"{seed}:{index}")
        for i in rng.sample(candidates, shots):
            shot = pool[i]
            parts.append(shot.context + task.target_delimiter + shot.choices[shot.label])
    parts.append(example.context)
    return task.description + task.fewshot_delimiter.join(parts)


def _stderr(outcomes: list[float]) -> float:
    n = len(outcomes)
    if n < 2:
        return float("nan")
    mean = sum(outcomes) / n
    variance = sum((x - mean) ** 2 for x in outcomes) / (n - 1)
    return math.sqrt(variance / n)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # ties: the first


def evaluate_task(
    model: torch.nn.Module,
    tokenizer,
    task: MultipleChoiceTask,
    *,
    shots: int = 0,
    seed: int = 1234,
    limit: int = 0,
    batch_size: int = 8,
    max_len: int | None = None,
    prefix: str = "eos",
    keep_samples: bool = False,
) -> TaskResult:
    """``acc`` and ``acc_norm`` of ``model`` on ``task`` at ``shots`` shots (first ``limit``
    examples when > 0)."""
    from densetrain.eval.perplexity import prefix_token_id

    if shots < 0 or limit < 0:
        raise UserError(f"shots and limit must be >= 0, got {shots} and {limit}")
    examples: list[Example] = task.examples[:limit] if limit else task.examples
    scorer = LogLikelihoodScorer(model, max_len=max_len, batch_size=batch_size)
    prompts = [fewshot_prompt(task, i, shots, seed) for i in range(len(examples))]
    pairs = [
        (prompt, task.target_delimiter + choice)
        for prompt, example in zip(prompts, examples, strict=True)
        for choice in example.choices
    ]
    scores = loglikelihoods(scorer, tokenizer, pairs, prefix_id=prefix_token_id(tokenizer, prefix))
    correct, correct_norm, samples = [], [], []
    offset = 0
    for example in examples:
        logprobs = [s.logprob for s in scores[offset : offset + len(example.choices)]]
        offset += len(example.choices)
        normed = [lp / max(1, len(c)) for lp, c in zip(logprobs, example.choices, strict=True)]
        pred, pred_norm = _argmax(logprobs), _argmax(normed)
        correct.append(float(pred == example.label))
        correct_norm.append(float(pred_norm == example.label))
        if keep_samples:
            samples.append({"id": example.id, "label": example.label, "logprobs": logprobs,
                            "pred": pred, "pred_norm": pred_norm})
    n = len(examples)
    return TaskResult(
        task=task.name, shots=shots, seed=seed, num_examples=n,
        acc=sum(correct) / n, acc_stderr=_stderr(correct),
        acc_norm=sum(correct_norm) / n, acc_norm_stderr=_stderr(correct_norm),
        fingerprint=task.fingerprint(), samples=samples,
    )
