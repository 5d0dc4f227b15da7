"""Bad raw inputs: one clear error, or a counted skip.

Damaged .zst files, lone UTF-16 surrogates in JSONL, non-text Parquet columns and null rows,
malformed-JSON positions, a leading BOM, broken symbolic links.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import synthetic_documents

from densetrain.data import train_tokenizer
from densetrain.data.sources import ReadStats, expand_inputs, iter_documents
from densetrain.errors import UserError

DOCS = synthetic_documents(30)


def _read(paths, **kwargs) -> tuple[list[str], ReadStats]:
    stats = ReadStats()
    docs = list(iter_documents([Path(p) for p in paths], stats=stats, **kwargs))
    return docs, stats


def _jsonl_bytes(count: int) -> bytes:
    return "".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(count)).encode()


# --- .zst inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("on_bad_line", ["error", "skip"])
def test_truncated_zstd_jsonl_is_an_error_not_a_bad_line(tmp_path, on_bad_line):
    zstandard = pytest.importorskip("zstandard")
    whole = zstandard.ZstdCompressor().compress(_jsonl_bytes(2000))
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"t\.jsonl\.zst could not be read: the file is truncated"):
        _read([path], on_bad_line=on_bad_line)


def test_zstd_reads_every_frame_and_refuses_a_truncated_text(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "ok.jsonl.zst"
    path.write_bytes(compressor.compress(_jsonl_bytes(2000))
                     + compressor.compress(b'{"text": "second frame"}\n'))
    docs, stats = _read([path])
    assert len(docs) == stats.documents == 2001 and docs[-1] == "second frame"
    assert docs[:2000] == [f"doc {i} " * 50 for i in range(2000)]
    whole = compressor.compress(b"hello world " * 5000)
    path = tmp_path / "t.txt.zst"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"t\.txt\.zst could not be read: the file is truncated"):
        _read([path])


def test_file_named_zst_that_is_not_zstd_is_an_error(tmp_path):
    path = tmp_path / "n.jsonl.zst"
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(UserError, match=r"n\.jsonl\.zst could not be read: not a valid zstd"):
        _read([path])


# --- JSONL lines ------------------------------------------------------------------------------


def test_lone_surrogate_is_a_bad_line_with_file_and_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "ok text"}\n{"text": "bad \\ud800 x"}\n'
                    '{"text": "pair \\ud83d\\ude00 ok"}\n')
    with pytest.raises(UserError, match=r"s\.jsonl:2: .*lone surrogate \\ud800, not valid Unicode"):
        _read([path])
    docs, stats = _read([path], on_bad_line="skip")
    assert docs == ["ok text", "pair \U0001f600 ok"]
    assert stats.skipped_lines == 1 and "s.jsonl:2" in stats.skipped_examples[0]


def test_lone_surrogate_in_tokenizer_corpus_names_file_and_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS)
                    + '{"text": "bad \\udfff"}\n')
    documents = iter_documents([path], stats=ReadStats())
    with pytest.raises(UserError, match=rf"s\.jsonl:{len(DOCS) + 1}: .*lone surrogate \\udfff"):
        train_tokenizer(documents, tmp_path / "tok" / "tokenizer.json", vocab_size=300)
    assert not (tmp_path / "tok").exists()


def test_malformed_json_names_the_column(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"text": "a"}\n{"text": "unterminated\n')
    with pytest.raises(UserError, match=r"m\.jsonl:2: malformed JSON \(Invalid control character "
                                        r"at column 23\)"):
        _read([path])
    path.write_text('{"text": "a"}\n{"text": }\n')
    with pytest.raises(UserError, match=r"m\.jsonl:2: malformed JSON \(Expecting value at "
                                        r"column 10\)"):
        _read([path])


def test_leading_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    docs, stats = _read([path])
    assert docs == ["first", "second"] and stats.skipped_lines == 0


# --- Parquet ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "type_name"), [(list(range(5)), "int64"),
                                                   ([["a", "b"]] * 3, "list<")])
def test_parquet_text_column_of_another_type_is_refused(tmp_path, values, type_name):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "i.parquet"
    pq.write_table(pa.table({"text": values}), path)
    with pytest.raises(UserError, match=rf"i\.parquet: column 'text' is of type {type_name}.*"
                                        "string or large_string"):
        _read([path])


def test_parquet_null_rows_are_bad_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["one", None, "two"]}), path)
    with pytest.raises(UserError, match=r"n\.parquet: row 2: column 'text' is null"):
        _read([path])
    docs, stats = _read([path], on_bad_line="skip")
    assert docs == ["one", "two"] and stats.skipped_lines == 1
    large = tmp_path / "large.parquet"
    pq.write_table(pa.table({"text": pa.array(["a b", "c d"], pa.large_string())}), large)
    assert _read([large])[0] == ["a b", "c d"]


# --- input paths ------------------------------------------------------------------------------


def test_broken_symlink_and_symlink_loop_are_named(tmp_path):
    dangling, loop = tmp_path / "d.txt", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "nowhere")
    loop.symlink_to(loop)
    with pytest.raises(FileNotFoundError, match="broken symbolic link: it points to .*nowhere"):
        expand_inputs([str(dangling)])
    with pytest.raises(FileNotFoundError, match="is a symbolic link loop"):
        expand_inputs([str(loop)])
