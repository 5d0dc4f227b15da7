"""The embedded default corpus: stdlib files, first-use prepare, cache, concurrent ranks."""

from __future__ import annotations

import time

import torch

from densetrain.data import DataConfig, build_data, load_metadata
from densetrain.data.default_corpus import stdlib_files
from densetrain.testing import run_distributed

SMALL = {"default_max_files": 12, "default_vocab_size": 400, "seq_len": 64, "seed": 11}


def test_stdlib_file_list_is_sorted_and_reproducible():
    files = stdlib_files()
    assert len(files) > 100 and files == stdlib_files()
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert stdlib_files(5) == files[:5]


def _rank_batches(rank: int, world_size: int, cache_dir: str) -> list[torch.Tensor]:
    cfg = DataConfig(cache_dir=cache_dir, **SMALL)
    bundle = build_data(cfg, dp_rank=rank, dp_size=world_size)
    return [bundle.train.next_batch(4).inputs for _ in range(3)]


def test_default_corpus_two_ranks_first_use_and_cache(tmp_path):
    cache = str(tmp_path / "cache")
    per_rank = run_distributed(_rank_batches, 2, cache, timeout=120)  # concurrent first use
    meta_files = list((tmp_path / "cache").glob("*/meta.json"))
    stamps = [m.stat().st_mtime_ns for m in meta_files]
    started = time.perf_counter()
    bundle = build_data(DataConfig(cache_dir=cache, **SMALL))  # cached: no second prepare
    assert time.perf_counter() - started < 10.0
    assert [m.stat().st_mtime_ns for m in meta_files] == stamps and len(stamps) == 1
    for step in range(3):
        single = bundle.train.next_batch(4).inputs
        assert torch.equal(torch.cat([per_rank[0][step], per_rank[1][step]]), single)
    root = bundle.train.stores[0].root
    meta = load_metadata(root)
    files = stdlib_files(12)
    assert [s["path"] for s in meta["sources"]] == [str(f) for f in files]
    assert meta["counts"]["read"]["documents"] == 12
    dirs = sorted(p.name for p in root.parent.iterdir() if p.is_dir())
    assert dirs == [root.name, root.name + ".tokenizer"]  # prepared once, by one rank
    assert (root / "tokenizer_config.json").is_file()
    text = bundle.tokenizer.decode(bundle.train.stores[0].read(0, 200))
    assert text == files[0].read_text()[: len(text)]
