"""Quality heuristics of the kind Gopher's MassiveText used (Rae et al. 2021, Appendix A.1.1).

Each rule returns the name of the first failed check (the removal reason counted in metadata) or
``None``. The default thresholds are the published ones: 50..100,000 words, mean word length
3..10, symbol-to-word ratio <= 0.1, <= 90% of lines starting with a bullet, <= 30% ending in an
ellipsis, and the repetition thresholds of Table A1 (duplicate lines/paragraphs and their
characters, top 2/3/4-gram and duplicate 5..10-gram character fractions).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_WORD = re.compile(r"\S+")
_BULLETS = ("•", "-", "*", "‣", "◦", "⁃", "▪", "·")
_ELLIPSES = ("...", "…")


@dataclass(kw_only=True)
class QualityConfig:
    """Thresholds of the quality filter (defaults: Gopher, Rae et al. 2021, A.1.1 / Table A1)."""

    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_line_fraction: float = 0.9
    max_ellipsis_line_fraction: float = 0.3
    max_duplicate_line_fraction: float = 0.3
    max_duplicate_paragraph_fraction: float = 0.3
    max_duplicate_line_char_fraction: float = 0.2
    max_duplicate_paragraph_char_fraction: float = 0.2
    max_top_ngram_char_fraction: dict[int, float] = field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16}
    )
    max_duplicate_ngram_char_fraction: dict[int, float] = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )


def _duplicate_fractions(items: list[str]) -> tuple[float, float]:
    """Fraction of items that repeat an earlier one, and the fraction of characters in them."""
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_items = dup_chars = 0
    for item in items:
        if item in seen:
            dup_items += 1
            dup_chars += len(item)
        seen.add(item)
    total_chars = sum(len(item) for item in items) or 1
    return dup_items / len(items), dup_chars / total_chars


def _top_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters covered by the most frequent n-gram (each occurrence) over all word chars."""
    if len(words) < n:
        return 0.0
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, count = counts.most_common(1)[0]
    if count < 2:
        return 0.0
    total = sum(len(w) for w in words) or 1
    return sum(len(w) for w in gram) * count / total


def _duplicate_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters of words inside n-grams that occur more than once, over all word characters."""
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = bytearray(len(words))
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i : i + n] = b"\x01" * n
    total = sum(len(w) for w in words) or 1
    return sum(len(w) for w, c in zip(words, covered, strict=True) if c) / total


def _rule_basic(text: str, words: list[str], cfg: QualityConfig) -> str | None:
    if not (cfg.min_words <= len(words) <= cfg.max_words):
        return "word_count"
    mean_len = sum(len(w) for w in words) / len(words)
    if not (cfg.min_mean_word_length <= mean_len <= cfg.max_mean_word_length):
        return "mean_word_length"
    # Gopher applies the ratio to the hash symbol and to the ellipsis separately.
    symbols = max(text.count("#"), text.count("...") + text.count("…"))
    if symbols / len(words) > cfg.max_symbol_word_ratio:
        return "symbol_word_ratio"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        bullets = sum(line.startswith(_BULLETS) for line in lines) / len(lines)
        if bullets > cfg.max_bullet_line_fraction:
            return "bullet_lines"
        ellipses = sum(line.endswith(_ELLIPSES) for line in lines) / len(lines)
        if ellipses > cfg.max_ellipsis_line_fraction:
            return "ellipsis_lines"
    return None


def _rule_repetition(text: str, words: list[str], cfg: QualityConfig) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line_frac, line_chars = _duplicate_fractions(lines)
    if line_frac > cfg.max_duplicate_line_fraction:
        return "duplicate_lines"
    if line_chars > cfg.max_duplicate_line_char_fraction:
        return "duplicate_line_chars"
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    para_frac, para_chars = _duplicate_fractions(paragraphs)
    if para_frac > cfg.max_duplicate_paragraph_fraction:
        return "duplicate_paragraphs"
    if para_chars > cfg.max_duplicate_paragraph_char_fraction:
        return "duplicate_paragraph_chars"
    for n, limit in sorted(cfg.max_top_ngram_char_fraction.items()):
        if _top_ngram_char_fraction(words, n) > limit:
            return f"top_{n}gram_chars"
    for n, limit in sorted(cfg.max_duplicate_ngram_char_fraction.items()):
        if _duplicate_ngram_char_fraction(words, n) > limit:
            return f"duplicate_{n}gram_chars"
    return None


def quality_reason(text: str, cfg: QualityConfig) -> str | None:
    """The first quality check ``text`` fails (a short reason name), or ``None`` if it passes."""
    words = _WORD.findall(text)
    if not words:
        return "word_count"
    return _rule_basic(text, words, cfg) or _rule_repetition(text, words, cfg)
