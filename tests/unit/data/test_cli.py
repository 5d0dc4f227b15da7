"""`densetrain data train-tokenizer | prepare | inspect` through the real entry point."""

from __future__ import annotations

import json

from data_helpers import synthetic_documents, write_text_files

from densetrain.cli.main import main
from densetrain.data import load_metadata, load_tokenizer


def test_cli_train_prepare_inspect(tmp_path, capsys):
    docs = synthetic_documents(30, seed=4) + [synthetic_documents(1, seed=4)[0]]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "c.jsonl").write_text(lines + "{bad json\n")
    tok = tmp_path / "tok" / "tokenizer.json"
    write_text_files(tmp_path / "txt", docs[:10])
    assert (
        main(
            [
                "data",
                "train-tokenizer",
                str(tmp_path / "txt"),
                "-o",
                str(tok),
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    assert load_tokenizer(tok).vocab_size <= 300
    args = [
        "data",
        "prepare",
        str(tmp_path / "c.jsonl"),
        "-o",
        str(tmp_path / "ds"),
        "--tokenizer",
        str(tok),
        "--exact-dedup",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "c.jsonl:32: malformed JSON" in err and "--on-bad-line=skip" in err
    assert "Traceback" not in err
    assert main([*args, "--on-bad-line", "skip"]) == 0
    meta = load_metadata(tmp_path / "ds")
    assert meta["counts"]["removed"] == {"exact_duplicate": 1}
    assert meta["counts"]["read"]["skipped_lines"] == 1
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "ds"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_documents"] == 30
    assert report["sample"].startswith(docs[0][:50])


def test_train_tokenizer_says_when_the_corpus_stops_it_short_and_what_it_skipped(tmp_path, capsys):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("import os\nprint(1)\n")
    (tmp_path / "txt" / "b.bin").write_bytes(b"\x7fELF\x00\x00" + bytes(range(256)))
    tok = tmp_path / "tok.json"
    argv = ["data", "train-tokenizer", str(tmp_path / "txt"), "-o", str(tok)]
    assert main([*argv, "--vocab-size", "300"]) == 0
    out, err = capsys.readouterr()
    size = load_tokenizer(tok).vocab_size
    assert size < 300  # 19 bytes of text have fewer than 41 pairs seen twice
    assert f"wrote {tok}: byte-level BPE, {size} tokens" in out and "from 1 document" in out
    assert "300 tokens were asked" in err and f"stopped at {size}" in err
    assert "skipped: 1 binary files" in err and "b.bin" in err
    before = tok.read_bytes()
    assert main([*argv, "--vocab-size", str(size)]) == 2  # never replaced silently
    assert "exists" in capsys.readouterr().err and tok.read_bytes() == before
    assert main([*argv, "--vocab-size", str(size), "--overwrite"]) == 0
    assert "were asked" not in capsys.readouterr().err  # the asked size reached: no note


def test_prepare_summarises_splits_and_counts_from_its_meta(tmp_path, capsys):
    docs = synthetic_documents(12, seed=5)
    write_text_files(tmp_path / "txt", docs + docs[:2])  # two exact duplicates
    tok = tmp_path / "tok.json"
    assert main(["data", "train-tokenizer", str(tmp_path / "txt"), "-o", str(tok),
                 "--vocab-size", "300"]) == 0
    capsys.readouterr()
    common = ["data", "prepare", str(tmp_path / "txt"), "--tokenizer", str(tok), "--exact-dedup",
              "--val-fraction", "0.25"]
    assert main([*common, "-o", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    meta = load_metadata(tmp_path / "ds")
    for name, split in meta["splits"].items():
        row = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert f"{split['num_tokens']:,} token" in row and f"{split['num_documents']:,} doc" in row
    assert "read 14 documents" in out and "removed 2 exact duplicates" in out
    assert main([*common, "-o", str(tmp_path / "ds2"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["counts"] == load_metadata(tmp_path / "ds2")["counts"]
    assert {k: v["tokens"] for k, v in report["splits"].items()} == {
        k: v["num_tokens"] for k, v in meta["splits"].items()}
