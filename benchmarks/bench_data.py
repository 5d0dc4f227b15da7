"""Data-pipeline benchmark: prepare throughput vs raw tokenizer speed, peak RSS, loader cost.

Run:  .venv/bin/python benchmarks/bench_data.py [--repeats 8] [--cache DIR]

1. The default corpus (the stdlib) is prepared on first use (timed), with its 8192 BPE.
2. Raw speed of the tokenizer's parallel batch encoding alone over the same texts (MB/s), and
   a paired comparison (raw encoding and prepare taking turns on the same ~6 MB).
3. ``prepare`` of the stdlib once and ``--repeats`` times over, each in a fresh process:
   throughput (MB/s of raw text) and peak RSS (ru_maxrss of that process).
4. Loader time per batch (seq 256, batch 8) against one training step of a tiny model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child_prepare(repeats: int, out: str, tokenizer: str) -> None:
    from densetrain.data import PrepareConfig, prepare_dataset
    from densetrain.data.default_corpus import stdlib_files

    files = [str(f) for f in stdlib_files()] * repeats
    raw_bytes = sum(Path(f).stat().st_size for f in files)
    start = time.perf_counter()
    meta = prepare_dataset(files, out, tokenizer=tokenizer, cfg=PrepareConfig(), overwrite=True)
    seconds = time.perf_counter() - start
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = meta["splits"]["train"]["num_tokens"]
    print(json.dumps({"bytes": raw_bytes, "seconds": seconds, "rss_mb": rss_mb, "tokens": tokens}))


def _raw_tokenizer_speed(tokenizer_path: Path) -> dict:
    from densetrain.data import load_tokenizer
    from densetrain.data.default_corpus import stdlib_files

    texts = [f.read_bytes().decode("utf-8", "replace") for f in stdlib_files()]
    raw_bytes = sum(len(t.encode()) for t in texts)
    backend = load_tokenizer(tokenizer_path)._backend
    start = time.perf_counter()
    for i in range(0, len(texts), 256):
        backend.encode_batch_fast(texts[i : i + 256], add_special_tokens=False)
    seconds = time.perf_counter() - start
    return {"bytes": raw_bytes, "seconds": seconds, "mb_per_s": raw_bytes / seconds / 1e6}


def _paired_overhead(tokenizer_path: Path, work: Path, rounds: int = 3) -> dict:
    """Raw batch encoding vs ``prepare`` on the same ~6 MB, taking turns (noisy shared machine).

    Returns the medians and their ratio: the share of raw tokenizer speed that prepare keeps.
    """
    from densetrain.data import PrepareConfig, load_tokenizer, prepare_dataset
    from densetrain.data.default_corpus import stdlib_files

    files, total = [], 0
    for f in stdlib_files():
        if total >= 6_000_000:
            break
        files.append(f)
        total += f.stat().st_size
    tok = load_tokenizer(tokenizer_path)
    raw_times, prepare_times = [], []
    for i in range(rounds):
        start = time.perf_counter()
        texts = [f.read_bytes().decode("utf-8", "replace") for f in files]
        for j in range(0, len(texts), 256):
            tok.encode_batch(texts[j : j + 256])
        raw_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        prepare_dataset(
            [str(f) for f in files], work / f"paired{i}", tokenizer=tok, cfg=PrepareConfig()
        )
        prepare_times.append(time.perf_counter() - start)
    raw, prep = sorted(raw_times)[rounds // 2], sorted(prepare_times)[rounds // 2]
    return {
        "bytes": total,
        "raw_mb_per_s": total / raw / 1e6,
        "prepare_mb_per_s": total / prep / 1e6,
        "prepare_over_raw": raw / prep,
    }


def _tiny_step_seconds(vocab_size: int, seq_len: int, batch: int) -> float:
    """Median time of one training step of a 2-layer, width-128 causal transformer."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, norm_first=True)
    model = nn.ModuleDict(
        {
            "emb": nn.Embedding(vocab_size, 128),
            "body": nn.TransformerEncoder(layer, 2),
            "out": nn.Linear(128, vocab_size),
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
    x = torch.randint(0, vocab_size, (batch, seq_len))
    times = []
    for _ in range(6):
        start = time.perf_counter()
        logits = model["out"](model["body"](model["emb"](x), mask=mask, is_causal=True))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def _loader_cost(dataset: Path) -> dict:
    from densetrain.data import DataConfig, build_data

    bundle = build_data(DataConfig(datasets=[str(dataset)], seq_len=256, document_masking=True))
    bundle.train.next_batch(8)
    start = time.perf_counter()
    for _ in range(200):
        bundle.train.next_batch(8)
    per_batch = (time.perf_counter() - start) / 200
    step = _tiny_step_seconds(bundle.tokenizer.vocab_size, 256, 8)
    return {"loader_ms": per_batch * 1e3, "tiny_step_ms": step * 1e3, "fraction": per_batch / step}


def main() -> None:
    """Run every measurement and print one JSON object."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--cache", default="")
    parser.add_argument("--child-prepare", nargs=3, metavar=("REPEATS", "OUT", "TOKENIZER"))
    args = parser.parse_args()
    if args.child_prepare:
        _child_prepare(int(args.child_prepare[0]), args.child_prepare[1], args.child_prepare[2])
        return
    from densetrain.data import ensure_default_corpus

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        cache = args.cache or tmp
        start = time.perf_counter()
        corpus = ensure_default_corpus(cache_dir=cache)
        results["default_corpus_first_use_s"] = time.perf_counter() - start
        start = time.perf_counter()
        ensure_default_corpus(cache_dir=cache)
        results["default_corpus_cached_s"] = time.perf_counter() - start
        tokenizer = corpus / "tokenizer.json"
        results["raw_tokenizer"] = _raw_tokenizer_speed(tokenizer)
        results["paired"] = _paired_overhead(tokenizer, Path(tmp))
        for repeats in (1, args.repeats):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child-prepare",
                    str(repeats),
                    f"{tmp}/p{repeats}",
                    str(tokenizer),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            child = json.loads(out.strip().splitlines()[-1])
            child["mb_per_s"] = child["bytes"] / child["seconds"] / 1e6
            results[f"prepare_x{repeats}"] = child
        results["loader"] = _loader_cost(corpus)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
