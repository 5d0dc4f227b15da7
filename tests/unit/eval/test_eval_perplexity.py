"""Perplexity / bits per byte against `transformers` computing the loss of the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import MAX_POSITIONS, hf_logprobs

from densetrain.data.prepare import PrepareConfig, prepare_dataset
from densetrain.eval.perplexity import (
    PerplexityConfig,
    dataset_perplexity,
    file_perplexity,
    text_perplexity,
)
from densetrain.eval.scoring import rolling_segments

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "x = 'é日本'  # non-ASCII: bytes differ from characters\n",
    "import os\n",
]
LONG_TEXT = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        return self.items.pop()\n"
)


def test_rolling_windows_reproduce_the_lm_eval_harness_example():
    # lm-evaluation-harness docs, LM.loglikelihood_rolling: tokens 0..9, prefix, context 4.
    prefix = 99
    segments = rolling_segments(list(range(10)), prefix_id=prefix, max_len=4)
    pairs = [(list(s.tokens[:-1]), list(s.tokens[1:])[-s.num_scored :]) for s in segments]
    assert pairs == [
        ([prefix, 0, 1, 2], [0, 1, 2, 3]),
        ([3, 4, 5, 6], [4, 5, 6, 7]),
        ([5, 6, 7, 8], [8, 9]),
    ]


@pytest.mark.parametrize("stride", [1, 3, 8])
def test_stride_scores_each_token_once_with_enough_context(stride):
    tokens = list(range(100, 130))
    segments = rolling_segments(tokens, prefix_id=0, max_len=8, stride=stride)
    scored = [t for s in segments for t in list(s.tokens[1:])[-s.num_scored :]]
    assert scored == tokens
    for s in segments[1:]:
        assert len(s.tokens) - 1 == 8  # later windows always get a full context
        assert len(s.tokens) - 1 - s.num_scored >= 8 - stride


def test_short_documents_equal_transformers_loss(hf_pair, tokenizer):
    hf_model, model, _ = hf_pair
    result = text_perplexity(model, tokenizer, TEXTS, PerplexityConfig(batch_size=2))
    expected_nats, expected_tokens = 0.0, 0
    for text in TEXTS:
        ids = [tokenizer.eos_id, *tokenizer.encode(text)]
        assert len(ids) <= MAX_POSITIONS + 1
        with torch.no_grad():  # transformers' own loss: mean CE of ids[1:] given the prefix
            out = hf_model(torch.tensor([ids]), labels=torch.tensor([ids]))
        expected_nats += float(out.loss) * (len(ids) - 1)
        expected_tokens += len(ids) - 1
    assert result.tokens == expected_tokens
    assert result.documents == len(TEXTS)
    assert result.nats == pytest.approx(expected_nats, rel=1e-5)
    assert result.loss == pytest.approx(expected_nats / expected_tokens, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected_nats / expected_tokens), rel=1e-5)


def test_bits_per_byte_is_nats_over_ln2_utf8_bytes(hf_pair, tokenizer):
    _, model, _ = hf_pair
    result = text_perplexity(model, tokenizer, TEXTS)
    utf8_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    assert utf8_bytes > sum(len(t) for t in TEXTS)  # the non-ASCII text counts bytes
    assert result.bytes == utf8_bytes
    assert result.bits_per_byte == pytest.approx(result.nats / (math.log(2) * utf8_bytes))
    assert result.word_perplexity == pytest.approx(
        math.exp(result.nats / sum(len(t.split()) for t in TEXTS))
    )


def test_sliding_window_stride_one_equals_per_token_transformers(hf_pair, tokenizer):
    hf_model, model, _ = hf_pair
    window = 8
    text = LONG_TEXT[:100]
    ids = [tokenizer.eos_id, *tokenizer.encode(text)]
    assert len(ids) > 4 * window
    cfg = PerplexityConfig(seq_len=window, stride=1, batch_size=16)
    result = text_perplexity(model, tokenizer, [text], cfg)
    # Token t is predicted from the `window` tokens before it: the first `window` tokens from
    # one prefix run, every later one as the last position of its own (batched) run.
    expected = -float(hf_logprobs(hf_model, ids[: window + 1]).sum())
    windows = torch.tensor([ids[t - window : t + 1] for t in range(window + 1, len(ids))])
    with torch.no_grad():
        logits = hf_model(windows[:, :-1]).logits[:, -1].double()
    expected -= float(logits.log_softmax(-1).gather(1, windows[:, -1:]).sum())
    assert result.tokens == len(ids) - 1
    assert result.nats == pytest.approx(expected, rel=1e-5)


def test_longer_than_window_costs_context(hf_pair, tokenizer):
    _, model, _ = hf_pair
    text = LONG_TEXT[:100]
    full = text_perplexity(model, tokenizer, [text], PerplexityConfig(seq_len=8, stride=8))
    sliding = text_perplexity(
        model, tokenizer, [text], PerplexityConfig(seq_len=8, stride=2, batch_size=32)
    )
    assert full.tokens == sliding.tokens
    assert full.nats != pytest.approx(sliding.nats, rel=1e-6)  # different contexts


def test_prepared_dataset_equals_raw_files(hf_pair, tokenizer, tmp_path):
    _, model, _ = hf_pair
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, text in enumerate([*TEXTS, LONG_TEXT]):
        (raw / f"{i}.txt").write_text(text, encoding="utf-8")
    prepare_dataset([str(raw)], tmp_path / "ds", tokenizer=tokenizer.path, cfg=PrepareConfig())
    cfg = PerplexityConfig(stride=16)
    from_files = file_perplexity(model, tokenizer, [raw], cfg)
    from_dataset = dataset_perplexity(model, tmp_path / "ds", cfg, split="train")
    assert from_dataset.as_dict() == pytest.approx(from_files.as_dict(), rel=1e-6)
    assert from_files.documents == 4


def test_errors_name_the_problem(hf_pair, tokenizer, tmp_path):
    _, model, _ = hf_pair
    with pytest.raises(ValueError, match="stride"):
        text_perplexity(model, tokenizer, TEXTS, PerplexityConfig(seq_len=8, stride=9))
    with pytest.raises(ValueError, match="prefix"):
        text_perplexity(model, tokenizer, TEXTS, PerplexityConfig(prefix="start"))
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text(TEXTS[0])
    prepare_dataset([str(raw)], tmp_path / "ds", tokenizer=tokenizer.path, cfg=PrepareConfig())
    with pytest.raises(ValueError, match="no tokens in split 'val'"):
        dataset_perplexity(model, tmp_path / "ds")
