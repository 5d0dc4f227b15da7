"""A task file that is not UTF-8 is refused naming the file and the line."""

from __future__ import annotations

import pytest

from densetrain.errors import describe_error
from densetrain.eval.tasks import load_examples

GOOD = '{"context": "1 + 1 =", "choices": [" 2", " 3"], "label": 0}\n'


def test_non_utf8_task_line_names_file_and_line(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(GOOD.encode() + b'{"context": "caf\xe9", "choices": ["a", "b"], "label": 0}\n')
    with pytest.raises(ValueError) as caught:
        load_examples(path)
    message = describe_error(caught.value)
    assert message.startswith(f"{path}:2: not UTF-8 text (byte 0xe9 at byte 17 of the line)")
    assert "\n" not in message


def test_incomplete_utf8_sequence_at_line_end_names_that_line(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(GOOD.encode() * 2 + b'{"context": "x\xc3\n' + GOOD.encode())
    with pytest.raises(ValueError, match=rf"^{path}:3: not UTF-8 text \(byte 0xc3"):
        load_examples(path)
