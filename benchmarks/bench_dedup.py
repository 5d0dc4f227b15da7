"""Gopher filters and MinHash dedup of densetrain against datatrove and datasketch.

Run:  .venv/bin/python benchmarks/bench_dedup.py [--max-files N] [--processes P] [--only X]
Needs: pip install datasketch datatrove  (not dependencies of densetrain)

Corpus: the default corpus (the standard-library ``.py`` files of this interpreter, one document
per file, sorted by path; the first ``--max-files``). For each pair it prints one JSON row:

- what is removed: counts of each and the Jaccard of the removed-document sets;
- speed on one core: MB of text per second of wall time and per CPU-second of this process;
- speed on ``--processes`` processes (default: every core): MB/s of wall time.

Gopher: densetrain's `quality_reason` against datatrove's ``GopherQualityFilter`` +
``GopherRepetitionFilter`` with the same rule set (datatrove's extra stop-word and alphabetic-word
rules off) and the same words (whitespace-separated; datatrove's default is spaCy's tokenizer).
MinHash: densetrain's `MinHashDeduplicator` (word 5-gram shingles, 128 permutations, 16 bands,
Jaccard 0.8) against datasketch ``MinHash`` + ``MinHashLSH`` on the same shingles and threshold
(datasketch picks its own band split); a candidate counts as a duplicate when its estimated
Jaccard reaches the threshold in both. Multi-process: signatures in the pool, LSH in the parent,
as ``densetrain data prepare --workers`` does.
Prepare: the whole ``prepare`` with filters and both dedups on one process and on
``--processes`` workers (the first 400 files unless ``--max-files``), checking equal metadata.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import time

_WORDS = re.compile(r"\w+", re.UNICODE)


def _texts(max_files: int) -> list[str]:
    from densetrain.data.default_corpus import stdlib_files
    from densetrain.data.sources import ReadStats, decode_utf8

    stats = ReadStats()
    return [decode_utf8(p.read_bytes(), stats) for p in stdlib_files(max_files)]


def _timed(fn, texts: list[str]):
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn(texts)
    return value, time.perf_counter() - wall, time.process_time() - cpu


def _pool_map(fn, texts: list[str], processes: int) -> tuple[list, float]:
    chunks = [texts[i::processes] for i in range(processes)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.map(fn, chunks)
    seconds = time.perf_counter() - start
    out: list = [None] * len(texts)
    for i, part in enumerate(parts):
        out[i::processes] = part
    return out, seconds


def ours_quality(texts: list[str]) -> list[bool]:
    """True for each text densetrain's Gopher filters remove."""
    from densetrain.data.filters import QualityConfig, quality_reason

    cfg = QualityConfig()
    return [quality_reason(t, cfg) is not None for t in texts]


def _datatrove_filters():
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        """Words as densetrain's filters see them: runs of non-space characters."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return text.splitlines()

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [m.span() for m in re.finditer(r"[^\n]+", text)]

    words = Whitespace()
    quality = GopherQualityFilter(min_stop_words=None, max_non_alpha_words_ratio=None,
                                  language=words)
    return quality, GopherRepetitionFilter(language=words)


def datatrove_quality(texts: list[str]) -> list[bool]:
    """True for each text datatrove's Gopher filters remove."""
    from datatrove.data import Document

    quality, repetition = _datatrove_filters()
    removed = []
    for i, text in enumerate(texts):
        doc = Document(text=text, id=str(i))
        keep = quality.filter(doc)
        keep = keep is True and repetition.filter(doc) is True
        removed.append(not keep)
    return removed


def ours_signatures(texts: list[str]) -> list:
    from densetrain.data.dedup import MinHashConfig, MinHashDeduplicator

    dedup = MinHashDeduplicator(MinHashConfig())
    return [dedup.signature(t) for t in texts]


def _shingles(text: str, size: int = 5) -> list[bytes]:
    words = _WORDS.findall(text.lower()) or [""]
    size = min(size, len(words))
    return [" ".join(words[i : i + size]).encode() for i in range(len(words) - size + 1)]


def datasketch_signatures(texts: list[str]) -> list:
    from datasketch import MinHash

    out = []
    for text in texts:
        minhash = MinHash(num_perm=128, seed=1, scheme="affine32")
        minhash.update_batch(_shingles(text))
        out.append(minhash.hashvalues)
    return out


def ours_lsh(signatures: list) -> list[bool]:
    from densetrain.data.dedup import MinHashConfig, MinHashDeduplicator

    dedup = MinHashDeduplicator(MinHashConfig())
    return [dedup.is_duplicate_signature(s) for s in signatures]


def datasketch_lsh(hashvalues: list) -> list[bool]:
    from datasketch import MinHash, MinHashLSH

    lsh, kept, removed = MinHashLSH(threshold=0.8, num_perm=128), {}, []
    for i, values in enumerate(hashvalues):
        minhash = MinHash(num_perm=128, seed=1, hashvalues=values, scheme="affine32")
        duplicate = any(kept[key].jaccard(minhash) >= 0.8 for key in lsh.query(minhash))
        if not duplicate:
            lsh.insert(str(i), minhash)
            kept[str(i)] = minhash
        removed.append(duplicate)
    return removed


def _row(name: str, texts: list[str], ours, theirs, processes: int) -> dict:
    """Run both sides on one core and on ``processes``; removed sets and speeds."""
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    row: dict = {"compare": name, "documents": len(texts), "MB": round(megabytes, 2)}
    removed = {}
    for side, (per_doc, finish) in (("densetrain", ours), ("library", theirs)):
        values, wall, cpu = _timed(per_doc, texts)
        flags, finish_wall, finish_cpu = _timed(finish, values) if finish else (values, 0.0, 0.0)
        removed[side] = {i for i, flag in enumerate(flags) if flag}
        pooled, pool_wall = _pool_map(per_doc, texts, processes)
        if finish:
            pairs = zip(pooled, values, strict=True)
            assert all(list(map(int, a)) == list(map(int, b)) for a, b in pairs)
        row[side] = {
            "removed": len(removed[side]),
            "MB_per_s_1_core": round(megabytes / (wall + finish_wall), 3),
            "MB_per_cpu_s": round(megabytes / max(cpu + finish_cpu, 1e-9), 3),
            f"MB_per_s_{processes}_processes": round(megabytes / (pool_wall + finish_wall), 3),
        }
    union = removed["densetrain"] | removed["library"]
    both = removed["densetrain"] & removed["library"]
    row["removed_both"] = len(both)
    row["jaccard_of_removed_sets"] = round(len(both) / len(union), 4) if union else 1.0
    return row


def prepare_row(max_files: int, processes: int) -> dict:
    """``prepare`` (filters, exact and MinHash dedup on) on one process and on ``processes``."""
    import tempfile

    from densetrain.data import PrepareConfig, prepare_dataset, train_tokenizer
    from densetrain.data.default_corpus import stdlib_files
    from densetrain.data.scaleout import prepare_dataset_parallel

    files = [str(p) for p in stdlib_files(max_files)]
    megabytes = sum(os.path.getsize(f) for f in files) / 1e6
    cfg = PrepareConfig(quality_filter=True, exact_dedup=True, near_dedup=True)
    row: dict = {"compare": "prepare, filters + both dedups", "files": len(files),
                 "MB": round(megabytes, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(_texts(max_files), f"{tmp}/tok.json", vocab_size=4096)
        start = time.perf_counter()
        single = prepare_dataset(files, f"{tmp}/one", tokenizer=tokenizer, cfg=cfg)
        row["MB_per_s_1_process"] = round(megabytes / (time.perf_counter() - start), 3)
        start = time.perf_counter()
        parallel = prepare_dataset_parallel(files, f"{tmp}/many", tokenizer=tokenizer, cfg=cfg,
                                            workers=processes)
        row[f"MB_per_s_{processes}_workers"] = round(megabytes / (time.perf_counter() - start), 3)
        row["same_metadata"] = json.dumps(single, sort_keys=True) == json.dumps(parallel,
                                                                              sort_keys=True)
    return row


def main() -> None:
    """Print one JSON row per comparison (Gopher filters, MinHash dedup)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-files", type=int, default=0, help="first N stdlib files (0: all)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", choices=("gopher", "minhash", "prepare"), default=None)
    args = parser.parse_args()
    texts = _texts(args.max_files)
    print(json.dumps({"machine": f"{os.cpu_count()} cores", "load_average": os.getloadavg()}))
    if args.only in (None, "gopher"):
        print(json.dumps(_row("gopher filters vs datatrove", texts, (ours_quality, None),
                              (datatrove_quality, None), args.processes)))
    if args.only in (None, "minhash"):
        print(json.dumps(_row("minhash dedup vs datasketch", texts, (ours_signatures, ours_lsh),
                              (datasketch_signatures, datasketch_lsh), args.processes)))
    if args.only in (None, "prepare"):
        print(json.dumps(prepare_row(args.max_files or 400, args.processes)))


if __name__ == "__main__":
    main()
