"""Shard checksums (cheap check on open, full check in verify_dataset), binary inputs skipped by
content, and an empty tokenizer corpus refused."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from data_helpers import synthetic_documents, write_text_files

from densetrain.data import PrepareConfig, TokenStore, prepare_dataset, train_tokenizer
from densetrain.data.shards import FORMAT_WITHOUT_CHECKSUMS, load_metadata, verify_dataset
from densetrain.data.sources import ReadStats, expand_inputs, iter_documents
from densetrain.errors import DamagedFileError, UserError


@pytest.fixture()
def dataset(prepared, tmp_path) -> Path:
    """A private copy of the shared prepared dataset (the tests damage it)."""
    return Path(shutil.copytree(prepared, tmp_path / "ds"))


def _first_shard(root: Path) -> Path:
    return root / load_metadata(root)["splits"]["train"]["shards"][0]["file"]


def test_checksums_are_the_sha256_of_the_files(dataset):
    meta = load_metadata(dataset)
    for split in meta["splits"].values():
        for entry in split["shards"]:
            data = (dataset / entry["file"]).read_bytes()
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
            assert entry["head_sha256"] == hashlib.sha256(data[: 1 << 16]).hexdigest()
            docs = (dataset / entry["docs"]).read_bytes()
            assert entry["docs_sha256"] == hashlib.sha256(docs).hexdigest()
    report = verify_dataset(dataset)
    assert report["shards"] == sum(len(s["shards"]) for s in meta["splits"].values())
    assert report["bytes"] == sum((dataset / e["file"]).stat().st_size
                                  for s in meta["splits"].values() for e in s["shards"])


def test_flipped_byte_past_the_head_is_found_by_verify_only(dataset, tmp_path):
    cfg = PrepareConfig(shard_tokens=1 << 20, batch_bytes=1 << 20)
    big = tmp_path / "big"
    write_text_files(big / "raw", synthetic_documents(800, seed=3))
    prepare_dataset([str(big / "raw")], big / "ds", tokenizer=dataset / "tokenizer.json", cfg=cfg)
    shard = _first_shard(big / "ds")
    data = bytearray(shard.read_bytes())
    assert len(data) > (1 << 16) + 10
    data[-7] ^= 0xFF  # a real flipped byte, beyond what the cheap check reads
    shard.write_bytes(bytes(data))
    TokenStore(big / "ds", "train")  # cheap check: size and head still match
    with pytest.raises(DamagedFileError, match=r"00000\.bin does not match its SHA-256"):
        verify_dataset(big / "ds")


@pytest.mark.parametrize("damage", ["flip-head", "truncate", "delete", "index"])
def test_damaged_shard_is_refused_when_opened(dataset, damage):
    shard = _first_shard(dataset)
    if damage == "flip-head":
        data = bytearray(shard.read_bytes())
        data[3] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-2])
    elif damage == "delete":
        shard.unlink()
    else:
        docs = shard.with_name(shard.name.replace(".bin", ".docs.npy"))
        lengths = np.load(docs)
        np.save(docs, np.roll(lengths, 1))  # same total, other document boundaries
    with pytest.raises(DamagedFileError, match=shard.name.split(".")[0]):
        TokenStore(dataset, "train")
    with pytest.raises(DamagedFileError):
        verify_dataset(dataset)


def test_shard_of_another_tokenizer_with_the_same_size_is_refused(dataset, tmp_path, corpus_docs):
    other = train_tokenizer([d.upper() for d in corpus_docs], tmp_path / "t2" / "tokenizer.json",
                            vocab_size=512)
    assert other.vocab_size == load_metadata(dataset)["tokenizer"]["vocab_size"]
    write_text_files(tmp_path / "raw2", [d.upper() for d in corpus_docs])
    prepare_dataset([str(tmp_path / "raw2")], tmp_path / "ds2", tokenizer=other,
                    cfg=PrepareConfig(shard_tokens=1 << 20))
    shard = _first_shard(dataset)
    foreign = _first_shard(tmp_path / "ds2").read_bytes()[: shard.stat().st_size]
    assert len(foreign) == shard.stat().st_size and foreign != shard.read_bytes()
    shard.write_bytes(foreign)
    with pytest.raises(DamagedFileError, match="another dataset or tokenizer"):
        TokenStore(dataset, "train")


def test_replaced_tokenizer_is_found_by_verify(dataset, tmp_path, corpus_docs):
    train_tokenizer(corpus_docs[:50], tmp_path / "t3" / "tokenizer.json", vocab_size=400)
    shutil.copyfile(tmp_path / "t3" / "tokenizer.json", dataset / "tokenizer.json")
    with pytest.raises(DamagedFileError, match="not the one the shards were tokenized with"):
        verify_dataset(dataset)


def test_dataset_without_checksums_opens_with_a_warning(dataset):
    meta = json.loads((dataset / "meta.json").read_text())
    meta["format"] = FORMAT_WITHOUT_CHECKSUMS
    for split in meta["splits"].values():
        for entry in split["shards"]:
            for key in ("sha256", "head_sha256", "docs_sha256"):
                entry.pop(key)
    (dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="without shard checksums"):
        store = TokenStore(dataset, "train")
    assert store.num_tokens == meta["splits"]["train"]["num_tokens"]


def test_garbage_metadata_is_named(dataset):
    (dataset / "meta.json").write_bytes(b"\x00\x01{garbage")
    with pytest.raises(DamagedFileError, match="meta.json is not valid JSON"):
        load_metadata(dataset)


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(52))) + chunk(b"IEND", b""))


def test_binary_files_are_skipped_by_content_and_counted(tmp_path):
    rng = random.Random(0)
    (tmp_path / "a.txt").write_text("plain text, naïve café\n" * 10, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 20)
    (tmp_path / "notes.bin").write_text("text in a file named .bin\n")
    (tmp_path / "img.png").write_bytes(_png())
    (tmp_path / "blob.bin").write_bytes(bytes(rng.randrange(256) for _ in range(4000)))
    (tmp_path / "fake.txt").write_bytes(bytes(rng.randrange(1, 256) for _ in range(4000)))
    stats = ReadStats()
    docs = list(iter_documents(expand_inputs([str(tmp_path)]), stats=stats))
    assert len(docs) == 3 and stats.documents == 3
    assert any("named .bin" in d for d in docs)  # judged by content, not by the name
    assert stats.skipped_binary_files == 3
    skipped = {Path(e.split(":")[0]).name for e in stats.skipped_binary_examples}
    assert skipped == {"img.png", "blob.bin", "fake.txt"}
    assert stats.invalid_utf8_documents == 1  # the Latin-1 text is read, its bytes replaced


def test_only_binary_inputs_is_an_error_naming_the_skipped(tmp_path, tokenizer_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "img.png").write_bytes(_png())
    with pytest.raises(UserError, match="1 binary files skipped"):
        prepare_dataset([str(tmp_path / "in")], tmp_path / "o", tokenizer=tokenizer_path)


@pytest.mark.parametrize("texts", [[], ["", "  \n"]])
def test_empty_tokenizer_corpus_is_an_error(tmp_path, texts):
    with pytest.raises(UserError, match="tokenizer corpus is empty"):
        train_tokenizer(texts, tmp_path / "tokenizer.json", vocab_size=300)
    assert not (tmp_path / "tokenizer.json").exists()
