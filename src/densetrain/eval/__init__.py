"""densetrain.eval: perplexity / bits per byte, multiple-choice few-shot tasks, harness adapter.

Public API::

    PerplexityConfig, PerplexityResult
    text_perplexity(model, tokenizer, texts, cfg)       file_perplexity(model, tokenizer, paths)
    dataset_perplexity(model, dataset_dir, cfg, split="val")
    MultipleChoiceTask, Example, load_task(name_or_file), load_jsonl_task(path, fewshot_path=)
    stdlib_next_line_task(...)                          the built-in offline task
    evaluate_task(model, tokenizer, task, shots=, seed=) -> TaskResult (acc, acc_norm)
    LogLikelihoodScorer, Segment, rolling_segments      the scoring primitive
    HarnessAdapter, make_lm_eval_model, run_lm_eval     lm-evaluation-harness interop
    load_for_eval(path, tokenizer=, device=)            model + tokenizer from any model dir
"""

from densetrain.eval.harness import TaskResult, evaluate_task, fewshot_prompt, split_pair
from densetrain.eval.lm_eval_adapter import HarnessAdapter, make_lm_eval_model, run_lm_eval
from densetrain.eval.loading import load_for_eval
from densetrain.eval.perplexity import (
    PerplexityConfig,
    PerplexityResult,
    dataset_perplexity,
    file_perplexity,
    text_perplexity,
)
from densetrain.eval.scoring import LogLikelihoodScorer, Segment, SegmentScore, rolling_segments
from densetrain.eval.tasks import (
    BUILTIN_TASKS,
    Example,
    MultipleChoiceTask,
    load_jsonl_task,
    load_task,
    stdlib_next_line_task,
)

__all__ = [
    "BUILTIN_TASKS",
    "Example",
    "HarnessAdapter",
    "LogLikelihoodScorer",
    "MultipleChoiceTask",
    "PerplexityConfig",
    "PerplexityResult",
    "Segment",
    "SegmentScore",
    "TaskResult",
    "dataset_perplexity",
    "evaluate_task",
    "fewshot_prompt",
    "file_perplexity",
    "load_for_eval",
    "load_jsonl_task",
    "load_task",
    "make_lm_eval_model",
    "rolling_segments",
    "run_lm_eval",
    "split_pair",
    "stdlib_next_line_task",
    "text_perplexity",
]
