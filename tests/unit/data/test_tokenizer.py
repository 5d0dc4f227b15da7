"""Tokenizer training and loading: round trips, HF loading, SentencePiece, fingerprints."""

from __future__ import annotations

import pytest

from densetrain.data import load_tokenizer, train_tokenizer

TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café — 数据 ✓ emoji 😀 tabs\tand\r\nCRLF",
    "   leading spaces and trailing   ",
    "<|eos|> looks special but is text",
    "",
]


def test_round_trip_text_tokens_text(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_special_tokens_and_vocab(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert 259 < tok.vocab_size <= 512  # BPE stops early when no pair repeats
    assert tok.eos_id not in tok.encode("<|eos|>")  # special-token text in data stays text
    assert tok.decode([tok.eos_id]) == "<|eos|>"


def test_transformers_loads_trained_file(tokenizer_path):
    transformers = pytest.importorskip("transformers")
    tok = load_tokenizer(tokenizer_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path))
    for text in TEXTS[:3]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path.parent))
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    assert auto.decode(auto.encode(TEXTS[1], add_special_tokens=False)) == TEXTS[1]


def test_fingerprint_stable_and_distinct(tmp_path, tokenizer_path, corpus_docs):
    first, again = load_tokenizer(tokenizer_path), load_tokenizer(tokenizer_path.parent)
    assert first.fingerprint == again.fingerprint
    other = train_tokenizer(corpus_docs[:50], tmp_path / "t.json", vocab_size=300)
    assert other.fingerprint != first.fingerprint


def test_sentencepiece_model_loads(tmp_path, corpus_docs):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_docs), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=200,
        model_type="bpe",
        pad_id=3,
        minloglevel=2,
    )
    tok = load_tokenizer(tmp_path / "sp.model")
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    text = "the model and the data"
    assert tok.encode(text) == reference.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (200, reference.eos_id(), 3)


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="could not be read"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match="vocab_size must be"):
        train_tokenizer(["x"], tmp_path / "t.json", vocab_size=100)
