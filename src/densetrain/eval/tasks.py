"""Multiple-choice tasks: the JSONL task format and built-in tasks that need no download.

JSONL format (one example per line, see docs/eval.md)::

    {"context": "The capital of France is", "choices": ["Paris", "Rome"], "label": 0}

``context`` (str), ``choices`` (a list of at least two distinct strings) and ``label`` (the
index of the right choice) are required; ``id`` and ``meta`` are allowed and carried along.
A second file of the same format may supply the few-shot examples; without one, shots are drawn
from the evaluation examples themselves, never the one being asked.

Built-in: ``stdlib-next-line``, generated deterministically from the Python standard library
sources of the running interpreter (the default training corpus): given the preceding lines of a
real file, pick its true next line among lines drawn from other files (re-indented like the true
line, so indentation alone does not give it away). By default only the files the default corpus
holds out for validation are used, so a model trained on that corpus is scored on unseen code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from densetrain.errors import UserError

_REQUIRED_KEYS = ("context", "choices", "label")
_ALLOWED_KEYS = (*_REQUIRED_KEYS, "id", "meta")


@dataclass(frozen=True, kw_only=True)
class Example:
    """One question: a context, its candidate continuations and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    label: int
    id: str | None = None


@dataclass(kw_only=True)
class MultipleChoiceTask:
    """Examples plus how prompts are assembled from them.

    ``target_delimiter`` joins a context and a choice (" " for prose, "\\n" for next-line code);
    ``fewshot_delimiter`` separates the solved examples of a few-shot prompt; ``description``
    starts every prompt. ``fewshot_examples`` None means shots come from ``examples``.
    """

    name: str
    examples: list[Example]
    fewshot_examples: list[Example] | None = None
    description: str = ""
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    metadata: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        """SHA-256 of the examples and prompt settings (two runs agree iff the task does)."""
        state = {
            "examples": [asdict(e) for e in self.examples],
            "fewshot": None if self.fewshot_examples is None else
            [asdict(e) for e in self.fewshot_examples],
            "description": self.description,
            "target_delimiter": self.target_delimiter,
            "fewshot_delimiter": self.fewshot_delimiter,
        }
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _example_from_json(record: object, where: str) -> Example:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in record]
    unknown = [k for k in record if k not in _ALLOWED_KEYS]
    if missing or unknown:
        problem = f"missing {missing}" if missing else f"unknown keys {unknown}"
        raise UserError(f"{where}: {problem}; allowed keys: {list(_ALLOWED_KEYS)}")
    context, choices, label = record["context"], record["choices"], record["label"]
    if not isinstance(context, str):
        raise UserError(f"{where}: 'context' must be a string, got {type(context).__name__}")
    if not (isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) for c in choices)):
        raise UserError(f"{where}: 'choices' must be a list of at least two strings")
    if len(set(choices)) != len(choices):
        raise UserError(f"{where}: 'choices' holds duplicates: {choices}")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise UserError(
            f"{where}: 'label' must be an integer index in [0, {len(choices) - 1}], got {label!r}"
        )
    ident = record.get("id")
    return Example(
        context=context, choices=tuple(choices), label=label,
        id=None if ident is None else str(ident),
    )


def load_examples(path: str | os.PathLike) -> list[Example]:
    """Examples of a JSONL task file; ``ValueError`` naming the file, line and problem."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"task file {path} does not exist")
    examples = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UserError(f"{where}: not valid JSON: {error}") from None
                examples.append(_example_from_json(record, where))
    except UnicodeDecodeError as error:
        raise UserError(_not_utf8(path, error)) from None
    if not examples:
        raise UserError(f"task file {path} holds no examples")
    return examples


def _not_utf8(path: Path, error: UnicodeDecodeError) -> str:
    """``FILE:LINE: not UTF-8 ...`` for the first line of ``path`` that does not decode."""
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            return (f"{path}:{number}: not UTF-8 text (byte 0x{raw[bad.start]:02x} at byte "
                    f"{bad.start + 1} of the line); a task file holds UTF-8 JSON lines")
    return f"{path}: not UTF-8 text ({error}); a task file holds UTF-8 JSON lines"


def load_jsonl_task(
    path: str | os.PathLike,
    *,
    fewshot_path: str | os.PathLike | None = None,
    name: str | None = None,
    description: str = "",
    target_delimiter: str = " ",
    fewshot_delimiter: str = "\n\n",
) -> MultipleChoiceTask:
    """A task from a JSONL file (and optionally a JSONL file of few-shot examples)."""
    return MultipleChoiceTask(
        name=name or Path(path).stem,
        examples=load_examples(path),
        fewshot_examples=load_examples(fewshot_path) if fewshot_path else None,
        description=description,
        target_delimiter=target_delimiter,
        fewshot_delimiter=fewshot_delimiter,
        metadata={"source": str(path), "fewshot_source": str(fewshot_path or "")},
    )


# ---------------------------------------------------------------------------- stdlib-next-line
def _held_out(text: str, val_fraction: float) -> bool:
    # The default corpus's own train/validation rule, so "held out" means exactly the documents
    # a model trained on the default corpus never saw.
    from densetrain.data.prepare import is_validation_document

    return is_validation_document(text, val_fraction)


def _candidate_line(line: str, min_chars: int) -> bool:
    return len(line.strip()) >= min_chars


def stdlib_next_line_task(
    *,
    num_examples: int = 500,
    num_fewshot_pool: int = 50,
    num_choices: int = 4,
    context_lines: int = 12,
    min_line_chars: int = 12,
    seed: int = 0,
    texts: dict[str, str] | None = None,
    held_out_only: bool = True,
    val_fraction: float = 0.02,
) -> MultipleChoiceTask:
    """The ``stdlib-next-line`` task (see the module docstring), deterministic for its arguments.

    ``texts`` ({name: source}) replaces the standard library (tests); ``held_out_only`` keeps the
    files the default corpus puts in its validation split at ``val_fraction``. Few-shot examples
    come from a separate draw that never overlaps the evaluation examples.
    """
    if num_choices < 2 or context_lines < 1 or num_examples < 1:
        raise UserError(
            "num_choices must be >= 2, context_lines and num_examples >= 1; got "
            f"{num_choices}, {context_lines}, {num_examples}"
        )
    if texts is None:
        from densetrain.data.default_corpus import stdlib_files

        root_files = stdlib_files()
        common = os.path.commonpath([str(p) for p in root_files])
        texts = {os.path.relpath(p, common): p.read_text("utf-8", "replace") for p in root_files}
    names = sorted(n for n, t in texts.items() if not held_out_only or _held_out(t, val_fraction))
    if len(names) < 2:
        raise UserError(f"stdlib-next-line needs at least 2 source files, found {len(names)}")
    lines = {n: texts[n].splitlines() for n in names}
    pool = [(n, line.strip()) for n in names for line in lines[n]
            if _candidate_line(line, min_line_chars)]
    targets = [(n, i) for n in names for i, line in enumerate(lines[n])
               if i >= context_lines and _candidate_line(line, min_line_chars)]
    rng = random.Random(f"stdlib-next-line:{seed}")
    wanted = min(len(targets), num_examples + num_fewshot_pool)
    chosen = rng.sample(targets, wanted)
    examples = [
        _next_line_example(lines[n], i, n, pool, num_choices, context_lines, rng)
        for n, i in chosen
    ]
    return MultipleChoiceTask(
        name="stdlib-next-line",
        examples=examples[: len(examples) - min(num_fewshot_pool, len(examples) // 2)],
        fewshot_examples=examples[len(examples) - min(num_fewshot_pool, len(examples) // 2) :],
        target_delimiter="\n",
        fewshot_delimiter="\n\n\n",
        metadata={"files": len(names), "held_out_only": held_out_only, "seed": seed},
    )


def _next_line_example(
    file_lines: list[str],
    index: int,
    name: str,
    pool: list[tuple[str, str]],
    num_choices: int,
    context_lines: int,
    rng: random.Random,
) -> Example:
    true_line = file_lines[index].rstrip()
    indent = true_line[: len(true_line) - len(true_line.lstrip())]
    seen = {true_line.strip()}
    distractors: list[str] = []
    for _ in range(100 * num_choices):
        if len(distractors) == num_choices - 1:
            break
        other_name, other = pool[rng.randrange(len(pool))]
        if other_name != name and other not in seen:
            seen.add(other)
            distractors.append(indent + other)
    if len(distractors) < num_choices - 1:
        raise UserError(f"too few distinct lines in other files to build {num_choices} choices")
    label = rng.randrange(num_choices)
    choices = [*distractors[:label], true_line, *distractors[label:]]
    context = "\n".join(file_lines[index - context_lines : index])
    return Example(context=context, choices=tuple(choices), label=label, id=f"{name}:{index + 1}")


BUILTIN_TASKS: dict[str, Callable[..., MultipleChoiceTask]] = {
    "stdlib-next-line": stdlib_next_line_task,
}


def load_task(spec: str, *, fewshot_path: str | os.PathLike | None = None) -> MultipleChoiceTask:
    """A built-in task by name or a JSONL task file by path."""
    if spec in BUILTIN_TASKS:
        if fewshot_path:
            raise UserError(f"built-in task {spec!r} brings its own few-shot examples")
        return BUILTIN_TASKS[spec]()
    if Path(spec).is_file():
        return load_jsonl_task(spec, fewshot_path=fewshot_path)
    raise UserError(
        f"task {spec!r} is neither a built-in task {sorted(BUILTIN_TASKS)} nor an existing "
        "JSONL file"
    )
