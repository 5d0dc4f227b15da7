"""prepare: shard contents against direct tokenization, formats, splits, resume, bad input."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from data_helpers import synthetic_documents, write_text_files

from densetrain.data import PrepareConfig, TokenStore, load_metadata, load_tokenizer
from densetrain.data import prepare_dataset as prepare
from densetrain.data.prepare import is_validation_document
from densetrain.data.shards import dtype_for_vocab


def _split_tokens(root, split):
    store = TokenStore(root, split)
    return store.read(0, store.num_tokens) if store.num_tokens else np.zeros(0, np.int64)


def test_shards_equal_direct_tokenization(prepared, corpus_docs, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    meta = load_metadata(prepared)
    assert meta["dtype"] == "uint16" and len(meta["splits"]["train"]["shards"]) > 1
    expected = {"train": [], "val": []}
    for doc in corpus_docs:  # independent reference: encode each document, EOS after each
        split = "val" if is_validation_document(doc, 0.1) else "train"
        expected[split] += tok.encode(doc) + [tok.eos_id]
    for split in ("train", "val"):
        assert _split_tokens(prepared, split).tolist() == expected[split]
    assert 0 < meta["splits"]["val"]["num_documents"] < 40
    total_docs = sum(s["num_documents"] for s in meta["splits"].values())
    assert total_docs == meta["counts"]["read"]["documents"] == len(corpus_docs)
    store = TokenStore(prepared, "train")
    first_doc = next(d for d in corpus_docs if not is_validation_document(d, 0.1))
    end = int(store.doc_starts[1]) - 1
    assert tok.decode(store.read(0, end)) == first_doc
    assert len(meta["sources"]) == len(corpus_docs) and len(meta["sources"][0]["sha256"]) == 64


def test_split_is_stable_by_document_hash(tmp_path, tokenizer_path, corpus_docs):
    docs = corpus_docs[:60]
    write_text_files(tmp_path / "a", docs)
    write_text_files(tmp_path / "b", docs[::-1] + synthetic_documents(20, seed=9))
    cfg = PrepareConfig(val_fraction=0.3)
    tok = load_tokenizer(tokenizer_path)
    prepare([str(tmp_path / "a")], tmp_path / "A", tokenizer=tok, cfg=cfg)
    prepare([str(tmp_path / "b")], tmp_path / "B", tokenizer=tok, cfg=cfg)

    def val_docs(root):
        text = tok.decode(_split_tokens(root, "val"))
        return set(text.split("<|eos|>")) - {""}

    assert {d for d in docs if d in val_docs(tmp_path / "B")} == val_docs(tmp_path / "A")


def test_jsonl_gz_zst_and_parquet(tmp_path, tokenizer_path):
    zstandard = pytest.importorskip("zstandard")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = synthetic_documents(9, seed=3)
    lines = "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs[:3]))
    (tmp_path / "a.jsonl").write_text(lines)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"body": d}) + "\n" for d in docs[3:6]))
    payload = "".join(json.dumps({"body": d}) + "\n" for d in docs[6:8]).encode()
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    pq.write_table(pa.table({"body": [docs[8]]}), tmp_path / "d.parquet")
    cfg = PrepareConfig(text_field="body")
    tok = load_tokenizer(tokenizer_path)
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "*.jsonl.*"), str(tmp_path / "d.parquet")]
    meta = prepare(inputs, tmp_path / "out", tokenizer=tok, cfg=cfg)
    assert meta["counts"]["read"]["documents"] == 9
    text = tok.decode(_split_tokens(tmp_path / "out", "train"))
    assert text == "".join(d + "<|eos|>" for d in docs)


def _run_interrupted(tmp_path, tokenizer_path, docs, cfg, monkeypatch):
    """Prepare once uninterrupted, once killed inside the third commit and then resumed."""
    write_text_files(tmp_path / "raw", docs)
    tok = load_tokenizer(tokenizer_path)
    prepare([str(tmp_path / "raw")], tmp_path / "full", tokenizer=tok, cfg=cfg)
    assert (
        prepare([str(tmp_path / "raw")], tmp_path / "part", tokenizer=tok, cfg=cfg, max_shards=2)
        is None
    )
    import densetrain.data.prepare as prepare_module

    original = prepare_module.write_shard

    def crash_after_train_shard(root, split, index, tokens, lengths):
        original(root, split, index, tokens, lengths)
        raise KeyboardInterrupt("simulated interruption after a shard file, before progress")

    monkeypatch.setattr(prepare_module, "write_shard", crash_after_train_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(tmp_path / "raw")], tmp_path / "part", tokenizer=tok, cfg=cfg)
    (tmp_path / "part" / "train" / "99999.bin.tmp").write_bytes(b"half-written")
    with pytest.raises(FileNotFoundError, match="interrupted prepare"):
        load_metadata(tmp_path / "part")
    monkeypatch.setattr(prepare_module, "write_shard", original)
    return prepare([str(tmp_path / "raw")], tmp_path / "part", tokenizer=tok, cfg=cfg)


def test_interrupted_prepare_resumes_identically(tmp_path, tokenizer_path, monkeypatch):
    docs = synthetic_documents(120, seed=5)
    docs += [docs[3].upper(), docs[10][:-3] + "extra words here\n"]  # exact and near dups
    cfg = PrepareConfig(
        val_fraction=0.2, shard_tokens=2000, batch_bytes=3000, exact_dedup=True, near_dedup=True
    )
    meta = _run_interrupted(tmp_path, tokenizer_path, docs, cfg, monkeypatch)
    full = load_metadata(tmp_path / "full")
    assert meta["splits"] == full["splits"] and meta["counts"] == full["counts"]
    assert full["counts"]["removed"] == {"exact_duplicate": 1, "near_duplicate": 1}
    for split in ("train", "val"):
        for entry in full["splits"][split]["shards"]:
            a = (tmp_path / "full" / entry["file"]).read_bytes()
            assert a == (tmp_path / "part" / entry["file"]).read_bytes()
    leftovers = sorted(p.name for p in (tmp_path / "part").rglob("*.tmp"))
    assert leftovers == []


def test_dtype_choice():
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.uint32


class _OutOfRangeTokenizer:
    """Wraps a tokenizer but emits an id beyond its vocabulary (a corrupted tokenizer)."""

    def __init__(self, tok):
        self.__dict__.update(tok.__dict__)
        self._inner = tok

    def encode_batch(self, texts):
        return [ids + [70000] for ids in self._inner.encode_batch(texts)]


def test_token_id_beyond_dtype_writes_no_shard(tmp_path, tokenizer_path):
    write_text_files(tmp_path / "raw", synthetic_documents(5))
    bad = _OutOfRangeTokenizer(load_tokenizer(tokenizer_path))
    bad.__class__ = type("T", (_OutOfRangeTokenizer, type(bad._inner)), {})
    with pytest.raises(ValueError, match="token id 70000 is outside"):
        prepare([str(tmp_path / "raw")], tmp_path / "out", tokenizer=bad)
    assert not list((tmp_path / "out").rglob("*.bin")) and not (tmp_path / "out/meta.json").exists()


def test_bad_inputs(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare([str(tmp_path / "missing.txt")], tmp_path / "o1", tokenizer=tok)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        prepare([str(tmp_path / "*.nothing")], tmp_path / "o2", tokenizer=tok)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="survived filtering"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "o3", tokenizer=tok)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="contain no documents"):
        prepare([str(tmp_path / "empty.jsonl")], tmp_path / "o4", tokenizer=tok)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(
            [str(tmp_path / "empty.txt")],
            tmp_path / "o5",
            tokenizer=tok,
            cfg=PrepareConfig(val_fraction=1.5),
        )


def test_non_utf8_replaced_and_counted(tmp_path, tokenizer_path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok \xff\xfe end")
    meta = prepare([str(tmp_path / "a.txt")], tmp_path / "o", tokenizer=tokenizer_path)
    assert meta["counts"]["read"]["invalid_utf8_documents"] == 1
    assert meta["counts"]["read"]["replaced_bytes"] == 3
    text = load_tokenizer(tokenizer_path).decode(_split_tokens(tmp_path / "o", "train"))
    assert text == "caf\ufffd ok \ufffd\ufffd end<|eos|>"


def test_malformed_jsonl_fails_or_skips(tmp_path, tokenizer_path):
    good = json.dumps({"text": "fine document"})
    lines = [good, "{broken", json.dumps(["not", "object"]), json.dumps({"other": "x"}), good]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"a\.jsonl:2: malformed JSON"):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "o1", tokenizer=tokenizer_path)
    assert not (tmp_path / "o1" / "meta.json").exists()
    cfg = PrepareConfig(on_bad_line="skip")
    meta = prepare([str(tmp_path / "a.jsonl")], tmp_path / "o2", tokenizer=tokenizer_path, cfg=cfg)
    read = meta["counts"]["read"]
    assert read["documents"] == 2 and read["skipped_lines"] == 3
    assert "a.jsonl:4: no field 'text'" in read["skipped_examples"][2]


def test_missing_parquet_column(tmp_path, tokenizer_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x y z"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="no column 'text'; columns: \\['content'\\]"):
        prepare([str(tmp_path / "a.parquet")], tmp_path / "o", tokenizer=tokenizer_path)


def test_resume_with_changed_inputs_refused(tmp_path, tokenizer_path):
    docs = synthetic_documents(40, seed=2)
    write_text_files(tmp_path / "raw", docs)
    cfg = PrepareConfig(shard_tokens=500, batch_bytes=500)
    prepare(
        [str(tmp_path / "raw")], tmp_path / "o", tokenizer=tokenizer_path, cfg=cfg, max_shards=1
    )
    (tmp_path / "raw" / "doc00000.txt").write_text("changed")
    with pytest.raises(ValueError, match="different sources"):
        prepare([str(tmp_path / "raw")], tmp_path / "o", tokenizer=tokenizer_path, cfg=cfg)
    with pytest.raises(FileExistsError):
        prepare([str(tmp_path / "raw")], tmp_path / "o2", tokenizer=tokenizer_path)
        prepare([str(tmp_path / "raw")], tmp_path / "o2", tokenizer=tokenizer_path)


def test_text_separator_streams_documents_across_read_blocks(tmp_path, monkeypatch):
    import densetrain.data.sources as sources

    monkeypatch.setattr(sources, "_READ_BLOCK", 7)  # force separators to straddle reads
    docs = ["first doc", "second — naïve", "", "third\nwith lines", "last"]
    (tmp_path / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")
    stats = sources.ReadStats()
    found = list(sources.iter_documents([tmp_path / "a.txt"], text_separator="\n\n", stats=stats))
    assert found == docs and stats.invalid_utf8_documents == 0
