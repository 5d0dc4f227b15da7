"""Few-shot multiple choice: log-likelihoods and accuracies against `transformers` scoring."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MAX_POSITIONS, hf_logprobs

from densetrain.eval.harness import evaluate_task, fewshot_prompt, loglikelihoods, split_pair
from densetrain.eval.scoring import LogLikelihoodScorer
from densetrain.eval.tasks import Example, MultipleChoiceTask, load_jsonl_task

PAIRS = [
    ("def add(a, b):\n    return", " a + b"),
    ("import ", "os"),
    ("", "print(1)"),  # empty context: the prefix token stands in
    ("x = 1\n" * 40, "y = 2"),  # longer than the window: left-truncated
]


def hf_pair_score(hf_model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """Reference: tokens split as lm-evaluation-harness does, scored by transformers."""
    ctx = context.rstrip()
    cont = context[len(ctx):] + continuation
    whole = tokenizer.encode(ctx + cont)
    n_ctx = len(tokenizer.encode(ctx))
    context_ids = whole[:n_ctx] or [tokenizer.eos_id]
    continuation_ids = whole[n_ctx:]
    ids = (context_ids + continuation_ids)[-(MAX_POSITIONS + 1):]
    logprobs = hf_logprobs(hf_model, ids)[-len(continuation_ids):]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids[:-1]])).logits[0, -len(continuation_ids):]
    greedy = bool((logits.argmax(-1) == torch.tensor(continuation_ids)).all())
    return float(logprobs.sum()), greedy


def test_split_moves_trailing_whitespace_into_the_continuation(tokenizer):
    context_ids, continuation_ids = split_pair(tokenizer, "return  ", "x")
    assert context_ids + continuation_ids == tokenizer.encode("return  x")
    assert context_ids == tokenizer.encode("return")


def test_loglikelihoods_equal_transformers(hf_pair, tokenizer):
    hf_model, model, _ = hf_pair
    scorer = LogLikelihoodScorer(model, batch_size=2)
    scores = loglikelihoods(scorer, tokenizer, PAIRS, prefix_id=tokenizer.eos_id)
    for (context, continuation), score in zip(PAIRS, scores, strict=True):
        expected, greedy = hf_pair_score(hf_model, tokenizer, context, continuation)
        assert score.logprob == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert score.is_greedy == greedy


def _task(tmp_path) -> MultipleChoiceTask:
    rows = [
        {"context": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None"],
         "label": 0},
        {"context": "import", "choices": ["os", "sys", "re"], "label": 1},
        {"context": "for i in", "choices": ["range(10):", "x", "[]:"], "label": 0},
        {"context": "class Foo", "choices": ["(object):", ":", "Bar"], "label": 2, "id": "c"},
        {"context": "if x ==", "choices": ["1:", "None:", "y"], "label": 1},
    ]
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_jsonl_task(path)


@pytest.mark.parametrize("shots", [0, 2])
def test_accuracy_equals_transformers_argmax(hf_pair, tokenizer, tmp_path, shots):
    hf_model, model, _ = hf_pair
    task = _task(tmp_path)
    result = evaluate_task(model, tokenizer, task, shots=shots, seed=7, keep_samples=True)
    correct = correct_norm = 0
    for index, (example, sample) in enumerate(zip(task.examples, result.samples, strict=True)):
        prompt = fewshot_prompt(task, index, shots, seed=7)
        logprobs = [hf_pair_score(hf_model, tokenizer, prompt, " " + c)[0]
                    for c in example.choices]
        assert sample["logprobs"] == pytest.approx(logprobs, rel=1e-5, abs=1e-4)
        normed = [lp / len(c) for lp, c in zip(logprobs, example.choices, strict=True)]
        correct += max(range(3), key=lambda i: logprobs[i]) == example.label
        correct_norm += max(range(3), key=lambda i: normed[i]) == example.label
    assert result.num_examples == 5
    assert result.acc == correct / 5
    assert result.acc_norm == correct_norm / 5
    p = result.acc
    assert result.acc_stderr == pytest.approx((p * (1 - p) / 4) ** 0.5)  # sample std / sqrt(n)


def test_fewshot_prompt_layout_and_determinism():
    examples = [Example(context=f"q{i}", choices=(f"a{i}", f"b{i}"), label=i % 2)
                for i in range(6)]
    task = MultipleChoiceTask(name="t", examples=examples, description="Answer.\n")
    prompt = fewshot_prompt(task, 0, 2, seed=3)
    assert prompt == fewshot_prompt(task, 0, 2, seed=3)
    assert prompt.startswith("Answer.\n") and prompt.endswith("\n\nq0")
    shots = prompt[len("Answer.\n"):].split("\n\n")[:-1]
    assert len(shots) == 2 and "q0 a0" not in shots
    for shot in shots:
        i = int(shot.split()[0][1:])
        assert shot == f"q{i} {examples[i].choices[examples[i].label]}"
    different = {fewshot_prompt(task, 0, 2, seed=s) for s in range(10)}
    assert len(different) > 1
    pool = [Example(context="p", choices=("x", "y"), label=1)]
    with_pool = MultipleChoiceTask(name="t", examples=examples, fewshot_examples=pool)
    assert fewshot_prompt(with_pool, 3, 1, seed=0) == "p y\n\nq3"
    with pytest.raises(ValueError, match="2 shots requested but the few-shot pool holds 1"):
        fewshot_prompt(with_pool, 3, 2, seed=0)
