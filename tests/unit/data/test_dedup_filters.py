"""Exact dedup, MinHash near-dedup (recall/precision on planted pairs), Gopher quality rules."""

from __future__ import annotations

import re

import numpy as np
import pytest
from data_helpers import WORDS

from densetrain.data import MinHashConfig, QualityConfig
from densetrain.data.dedup import ExactDeduplicator, MinHashDeduplicator
from densetrain.data.filters import quality_reason


def _shingles(text: str, k: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + k]) for i in range(len(words) - k + 1)}


def _jaccard(a: str, b: str, k: int = 5) -> float:
    sa, sb = _shingles(a, k), _shingles(b, k)
    return len(sa & sb) / len(sa | sb)


def test_exact_dedup_normalises_case_and_whitespace():
    dedup = ExactDeduplicator()
    assert not dedup.is_duplicate("Hello   World\n")
    assert dedup.is_duplicate("hello world")
    assert dedup.is_duplicate("  HELLO\tWORLD ")
    assert not dedup.is_duplicate("hello world!")


def test_minhash_recall_and_precision_on_planted_near_duplicates():
    rng = np.random.default_rng(7)
    vocab = [f"{w}{i}" for i in range(40) for w in WORDS]  # a large vocabulary: low overlap
    originals = [" ".join(rng.choice(vocab, size=300)) for _ in range(150)]
    planted = []
    for text in originals[:100]:
        words = text.split()
        for i in rng.choice(len(words), size=2, replace=False):  # edit 2 of 300 words
            words[i] = str(rng.choice(vocab))
        planted.append(" ".join(words))
    truth = [_jaccard(o, p) for o, p in zip(originals[:100], planted, strict=True)]
    assert min(truth) >= 0.9  # every planted pair is a true near-duplicate (reference Jaccard)
    dedup = MinHashDeduplicator(MinHashConfig(threshold=0.8))
    assert not any(dedup.is_duplicate(o) for o in originals)  # precision on distinct documents
    flagged = [dedup.is_duplicate(p) for p in planted]
    recall = sum(flagged) / len(flagged)
    assert recall >= 0.95, recall
    unrelated = [" ".join(rng.choice(vocab, size=300)) for _ in range(100)]
    false_positives = sum(dedup.is_duplicate(u) for u in unrelated)
    assert false_positives == 0


def test_minhash_estimate_tracks_true_jaccard():
    rng = np.random.default_rng(1)
    vocab = [f"w{i}" for i in range(5000)]
    base = list(rng.choice(vocab, size=400))
    dedup = MinHashDeduplicator(MinHashConfig(num_perm=256, bands=32))
    for edits in (10, 40, 120):
        other = list(base)
        for i in rng.choice(len(other), size=edits, replace=False):
            other[i] = "zz" + str(i)
        a, b = " ".join(base), " ".join(other)
        estimate = float(np.mean(dedup.signature(a) == dedup.signature(b)))
        assert abs(estimate - _jaccard(a, b)) < 0.1  # std of the estimator ~ 0.03 at 256 perms


def test_minhash_config_validation():
    with pytest.raises(ValueError, match="multiple of bands"):
        MinHashConfig(num_perm=100, bands=16).validate()
    with pytest.raises(ValueError, match="threshold"):
        MinHashConfig(threshold=0).validate()


def _prose(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = rng.choice([w for w in WORDS if len(w) >= 3] + ["language", "between"], n_words)
    return ".\n".join(" ".join(words[i : i + 10]) for i in range(0, n_words, 10)) + "."


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("too few words here", "word_count"),
        (" ".join(["a b"] * 60), "mean_word_length"),
        (" ".join(["#tag word here"] * 30), "symbol_word_ratio"),
        ("\n".join(f"- item number {i} of list" for i in range(30)), "bullet_lines"),
        ("\n".join(f"sentence {i} continues onwards..." for i in range(30)), "symbol_word_ratio"),
        ("\n".join(f"sentence {i} continues onwards…" for i in range(30)), "symbol_word_ratio"),
    ],
)
def test_quality_rules_reject(text, reason):
    assert quality_reason(text, QualityConfig()) == reason


def test_quality_ellipsis_and_repetition_rules():
    cfg = QualityConfig(max_symbol_word_ratio=10.0)
    ellipses = "\n".join(f"sentence {i} trails off into silence…" for i in range(30))
    assert quality_reason(ellipses, cfg) == "ellipsis_lines"
    repeated = "\n".join(["the same line of text again"] * 10 + [_prose(60, 1)])
    assert quality_reason(repeated, QualityConfig()) == "duplicate_lines"
    ngram = " ".join(["data model"] * 40) + " " + _prose(60, 2)
    assert quality_reason(ngram, QualityConfig()) == "top_2gram_chars"


def test_quality_passes_ordinary_prose():
    assert quality_reason(_prose(200), QualityConfig()) is None
