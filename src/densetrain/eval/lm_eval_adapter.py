"""EleutherAI lm-evaluation-harness adapter: a densetrain model behind the harness's ``LM`` API.

``HarnessAdapter`` implements the three request types on anything with an ``args`` tuple (the
harness's ``Instance``), without importing ``lm_eval``:

- ``loglikelihood``: args ``(context, continuation)`` -> ``(sum of log-probs, is_greedy)``;
- ``loglikelihood_rolling``: args ``(text,)`` -> log-likelihood of the whole text, every token
  predicted once (disjoint windows, the last one with a full context);
- ``generate_until``: args ``(context, gen_kwargs)`` with ``until`` (str or list),
  ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_k``, ``top_p`` -> the continuation,
  cut before the first stop string. Decoding goes through ``densetrain.generate`` (KV cache).

Requests are read as the harness's own Hugging Face backend (``model="hf"``) reads them, so the
two give the same results on an exported run (tests/unit/eval/test_eval_lm_eval_real.py), with
one choice of densetrain's: the prefix token (before an empty context or a rolling text) is
``prefix="eos"`` by default, the document separator densetrain trains with, where the ``hf``
backend takes the tokenizer's BOS when it has one (``prefix="bos"``, or ``prefix_token_id=`` in
the ``hf`` backend's model_args, makes them agree).

``make_lm_eval_model`` wraps it in a subclass of ``lm_eval.api.model.LM``, ``run_lm_eval``
calls ``lm_eval.simple_evaluate`` (task names checked first, local task YAML files found
through ``include_path``); they import ``lm_eval`` only when called (an optional dependency:
``pip install lm-eval``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from densetrain.errors import MissingDependencyError, UserError, UserNotADirectoryError
from densetrain.eval.harness import loglikelihoods
from densetrain.eval.perplexity import prefix_token_id
from densetrain.eval.scoring import LogLikelihoodScorer, rolling_segments

_GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _args(request: Any, count: int, kind: str) -> tuple:
    args = getattr(request, "args", None)
    if not isinstance(args, tuple) or len(args) < count:
        raise ValueError(f"{kind} request needs .args with {count} entries, got {args!r}")
    return args


class HarnessAdapter:
    """The lm-evaluation-harness request methods over a densetrain ``Transformer``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        batch_size: int = 8,
        max_len: int | None = None,
        prefix: str = "eos",
        max_gen_toks: int = 256,
        seed: int = 1234,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.scorer = LogLikelihoodScorer(model, max_len=max_len, batch_size=batch_size)
        self.prefix_id = prefix_token_id(tokenizer, prefix)
        self.max_gen_toks = max_gen_toks
        self.generator = torch.Generator(device=self.scorer.device).manual_seed(seed)

    @property
    def max_length(self) -> int:
        """Tokens of context the model is given."""
        return self.scorer.max_len

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` for each ``(context, continuation)``."""
        pairs = [_args(r, 2, "loglikelihood")[:2] for r in requests]
        scores = loglikelihoods(self.scorer, self.tokenizer, pairs, prefix_id=self.prefix_id)
        return [(s.logprob, s.is_greedy) for s in scores]

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        """Log-likelihood of each whole text (``args = (text,)``), for perplexity tasks."""
        owners, segments = [], []
        for index, request in enumerate(requests):
            (text,) = _args(request, 1, "loglikelihood_rolling")[:1]
            windows = rolling_segments(
                self.tokenizer.encode(text), prefix_id=self.prefix_id, max_len=self.max_length
            )
            owners.extend([index] * len(windows))
            segments.extend(windows)
        totals = [0.0] * len(requests)
        for owner, score in zip(owners, self.scorer.score(segments), strict=True):
            totals[owner] += score.logprob
        return totals

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Greedy (or sampled, per ``gen_kwargs``) continuations cut at the first stop string."""
        return [self._generate_one(*_args(r, 2, "generate_until")[:2]) for r in requests]

    def _generate_one(self, context: str, gen_kwargs: dict) -> str:
        from densetrain.generate import generate

        unknown = sorted(set(gen_kwargs) - set(_GEN_KEYS))
        if unknown:
            raise UserError(f"unsupported gen_kwargs {unknown}; supported: {list(_GEN_KEYS)}")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        sample = bool(gen_kwargs.get("do_sample", False))
        temperature = float(gen_kwargs.get("temperature", 0.0)) if sample else 0.0
        ids = self.tokenizer.encode(context) or [self.prefix_id]
        ids = ids[-max(1, self.max_length - max_new):]
        prompt_1S = torch.tensor([ids], device=self.scorer.device)
        out_1T = generate(
            self.model, prompt_1S, max_new, temperature=temperature,
            top_k=gen_kwargs.get("top_k"), top_p=gen_kwargs.get("top_p"),
            eos_token_id=self.tokenizer.eos_id, generator=self.generator,
        )
        new_ids = out_1T[0, len(ids):].tolist()
        if self.tokenizer.eos_id in new_ids:
            new_ids = new_ids[: new_ids.index(self.tokenizer.eos_id)]
        text = self.tokenizer.decode(new_ids)
        cuts = [text.index(stop) for stop in until if stop and stop in text]
        return text[: min(cuts)] if cuts else text


def _require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError(
            "lm-evaluation-harness is not installed; `pip install lm-eval` to use it"
        ) from error


def make_lm_eval_model(model: torch.nn.Module, tokenizer, **options: Any):
    """An ``lm_eval.api.model.LM`` instance over ``model`` (needs ``pip install lm-eval``)."""
    _require_lm_eval()
    from lm_eval.api.model import LM

    adapter = HarnessAdapter(model, tokenizer, **options)

    class DensetrainLM(LM):
        """densetrain model as an lm-evaluation-harness ``LM``."""

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return adapter.loglikelihood(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return adapter.loglikelihood_rolling(requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return adapter.generate_until(requests)

    return DensetrainLM()


def harness_task_manager(include_path: str | os.PathLike | None = None):
    """An ``lm_eval.tasks.TaskManager`` of the harness's tasks plus the task YAML files under
    ``include_path`` (a directory; ``NotADirectoryError`` naming it when it is not one)."""
    if include_path is not None and not Path(include_path).is_dir():
        what = "is a file" if Path(include_path).exists() else "does not exist"
        raise UserNotADirectoryError(
            f"include path {include_path} {what}; give a directory of harness task YAML files"
        )
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path) if include_path is not None else None)


def unknown_tasks(task_manager, tasks: Sequence[str]) -> list[str]:
    """The names of ``tasks`` (globs allowed) that match no task, group or tag."""
    return [t for t in tasks if not task_manager.match_tasks([t])]


def run_lm_eval(
    model: torch.nn.Module,
    tokenizer,
    tasks: list[str],
    *,
    num_fewshot: int | None = None,
    limit: int | None = None,
    include_path: str | os.PathLike | None = None,
    task_manager=None,
    **options: Any,
) -> dict:
    """``lm_eval.simple_evaluate`` on ``tasks`` (harness task names, or names of tasks defined
    under ``include_path``); returns its results. A name that matches no task is a
    ``ValueError`` naming it, raised before anything is evaluated."""
    if task_manager is None:
        task_manager = harness_task_manager(include_path)
    missing = unknown_tasks(task_manager, tasks)
    if missing:
        where = f" or under {include_path}" if include_path is not None else ""
        raise UserError(f"unknown harness task(s) {missing}: not lm-evaluation-harness tasks"
                        f"{where}")
    lm = make_lm_eval_model(model, tokenizer, **options)
    import lm_eval

    output = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
        task_manager=task_manager,
    )
    if not output:
        return {}
    # Plain JSON values: the harness leaves numpy scalars (np.float64, np.int64) in its results.
    return json.loads(json.dumps(output["results"], default=_plain_value))


def _plain_value(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)
