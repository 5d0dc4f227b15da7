"""Task files and the built-in stdlib-next-line task."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from conftest import corpus_texts

from densetrain.data.prepare import PrepareConfig, prepare_dataset
from densetrain.data.shards import TokenStore
from densetrain.eval.tasks import load_examples, load_task, stdlib_next_line_task


def _write(path, *lines: str) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"context": "a", "choices": ["x", "y"]}', r"t.jsonl:2: missing \['label'\]"),
        ('{"context": "a", "choices": ["x", "y"], "label": 2}', r"t.jsonl:2: 'label' must be"),
        ('{"context": "a", "choices": ["x", "x"], "label": 0}', "duplicates"),
        ('{"context": "a", "choices": ["x"], "label": 0}', "at least two strings"),
        ('{"context": "a", "choices": ["x", "y"], "label": 0, "answer": 1}', "unknown keys"),
        ('{"context": "a", "choices": ["x", "y"], "label": true}', "'label' must be"),
        ("not json", r"t.jsonl:2: not valid JSON"),
    ],
)
def test_bad_task_lines_name_file_line_and_problem(tmp_path, line, message):
    good = '{"context": "q", "choices": ["x", "y"], "label": 1, "id": 7}'
    path = _write(tmp_path / "t.jsonl", good, line)
    with pytest.raises(ValueError, match=message):
        load_examples(path)


def test_task_file_and_fewshot_file(tmp_path):
    path = _write(tmp_path / "t.jsonl", '{"context": "q", "choices": ["x", "y"], "label": 1}')
    shots = _write(tmp_path / "s.jsonl", '{"context": "p", "choices": ["u", "v"], "label": 0}')
    task = load_task(path, fewshot_path=shots)
    assert task.name == "t" and task.examples[0].choices == ("x", "y")
    assert task.fewshot_examples[0].context == "p"
    with pytest.raises(ValueError, match="neither a built-in task"):
        load_task(str(tmp_path / "missing.jsonl"))


def _sources() -> dict[str, str]:
    return {f"f{i}.py": text for i, text in enumerate(corpus_texts())}


def test_stdlib_next_line_examples_are_real_next_lines():
    sources = _sources()
    task = stdlib_next_line_task(num_examples=60, num_fewshot_pool=10, texts=sources,
                                 held_out_only=False, context_lines=5)
    assert len(task.examples) == 60 and len(task.fewshot_examples) == 10
    assert not {e.id for e in task.examples} & {e.id for e in task.fewshot_examples}
    for example in task.examples:
        name, line = example.id.rsplit(":", 1)
        source_lines = sources[name].splitlines()
        index = int(line) - 1
        assert example.context == "\n".join(source_lines[index - 5 : index])
        true_line = example.choices[example.label]
        assert true_line == source_lines[index].rstrip()
        indent = true_line[: len(true_line) - len(true_line.lstrip())]
        others = {s.strip() for n, t in sources.items() if n != name for s in t.splitlines()}
        for i, choice in enumerate(example.choices):
            assert choice.startswith(indent)  # indentation gives nothing away
            if i != example.label:
                assert choice.strip() in others and choice.strip() != true_line.strip()
    labels = Counter(e.label for e in task.examples)
    assert set(labels) == {0, 1, 2, 3}


def test_stdlib_next_line_is_deterministic_per_seed():
    sources = _sources()
    make = lambda seed: stdlib_next_line_task(  # noqa: E731
        num_examples=20, texts=sources, held_out_only=False, seed=seed
    )
    assert make(0).fingerprint() == make(0).fingerprint()
    assert make(0).fingerprint() != make(1).fingerprint()


def test_held_out_files_are_the_default_corpus_validation_split(tokenizer, tmp_path):
    sources = _sources()
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, text in sources.items():
        (raw / name).write_text(text, encoding="utf-8")
    cfg = PrepareConfig(val_fraction=0.5)
    prepare_dataset([str(raw)], tmp_path / "ds", tokenizer=tokenizer.path, cfg=cfg)
    store = TokenStore(tmp_path / "ds", "val")
    ends = np.append(store.doc_starts[1:], store.num_tokens)
    val_texts = {tokenizer.decode(store.read(int(s), int(e - s))[:-1].tolist())
                 for s, e in zip(store.doc_starts, ends, strict=True)}
    task = stdlib_next_line_task(num_examples=20, num_fewshot_pool=2, texts=sources,
                                 val_fraction=0.5)
    used = {e.id.rsplit(":", 1)[0] for e in task.examples + task.fewshot_examples}
    assert 0 < len(val_texts) < len(sources)
    assert {sources[name] for name in used} <= val_texts
    assert task.metadata["files"] == len(val_texts)


def test_builtin_task_over_the_real_standard_library():
    task = load_task("stdlib-next-line")
    assert len(task.examples) == 500 and task.target_delimiter == "\n"
    assert json.dumps(task.metadata)
