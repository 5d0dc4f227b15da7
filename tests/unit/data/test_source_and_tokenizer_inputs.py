"""Bad raw inputs and bad tokenizer-training arguments: one clear error, or a counted skip.

Damaged .zst files, lone UTF-16 surrogates in JSONL, non-text Parquet columns and null rows,
malformed-JSON positions, a leading BOM, broken symbolic links; train_tokenizer's vocabulary
size, min_frequency, special-token names and output, and the tokenizer_config.json sidecar.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from data_helpers import synthetic_documents

from densetrain.data import load_tokenizer, train_tokenizer
from densetrain.data.sources import ReadStats, expand_inputs, iter_documents
from densetrain.data.tokenizer import hf_config_path
from densetrain.errors import UserError

DOCS = synthetic_documents(30)


def _read(paths, **kwargs) -> tuple[list[str], ReadStats]:
    stats = ReadStats()
    docs = list(iter_documents([Path(p) for p in paths], stats=stats, **kwargs))
    return docs, stats


def _jsonl_bytes(count: int) -> bytes:
    return "".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(count)).encode()


def _never_read():
    raise AssertionError("the corpus was read although the arguments were refused")
    yield ""  # pragma: no cover - makes this a generator


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


def test_a_broken_link_or_fifo_inside_an_input_directory_is_named_not_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("some text")
    (corpus / ".hidden").symlink_to(tmp_path / "nowhere")  # hidden: skipped as documented
    assert expand_inputs([str(corpus)]) == [corpus / "a.txt"]
    (corpus / "sub" / "b.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(FileNotFoundError, match=r"broken symbolic link: it points to .*gone\.txt"
                                                r".*inside input directory") as refused:
        expand_inputs([str(corpus)])
    assert str(corpus / "sub" / "b.txt") in str(refused.value)
    (corpus / "sub" / "b.txt").unlink()
    os.mkfifo(corpus / "pipe")
    with pytest.raises(FileNotFoundError, match="not a regular file or directory .*FIFO"):
        expand_inputs([str(corpus)])


# --- train_tokenizer arguments and output -----------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(vocab_size=5_000_000_000), r"--vocab-size 5,000,000,000 is out of range"),
    (dict(vocab_size=258), r"--vocab-size 258 is out of range: vocab_size must be between 259"),
    (dict(vocab_size=300, min_frequency=-3), r"--min-frequency .* 0 or more.* got -3"),
])
def test_bad_training_arguments_are_refused_before_reading(tmp_path, kwargs, match):
    with pytest.raises(UserError, match=match):
        train_tokenizer(_never_read(), tmp_path / "t.json", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_output_that_is_a_directory_is_refused_and_nothing_left(tmp_path):
    (tmp_path / "tokdir").mkdir()
    with pytest.raises(UserError, match=r"--output .*tokdir is a directory.*tokdir/tokenizer"):
        train_tokenizer(_never_read(), tmp_path / "tokdir", vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokdir"]


@pytest.fixture()
def read_only_dir(tmp_path):
    """A directory that cannot be written: a read-only tmpfs as root, else mode 0o555."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_output_is_refused_before_training(read_only_dir):
    with pytest.raises(UserError, match=r"--output .*ro/sub/a\.json cannot be written"):
        train_tokenizer(_never_read(), read_only_dir / "sub" / "a.json", vocab_size=300)


def test_output_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"f is a file, not a directory"):
        train_tokenizer(_never_read(), tmp_path / "f" / "t.json", vocab_size=300)


def test_custom_special_names_outside_tokenizer_json_are_refused_before_training(tmp_path):
    with pytest.raises(UserError, match=r"would not find BOS 'BOS'.*c/tokenizer\.json"):
        train_tokenizer(_never_read(), tmp_path / "c.json", vocab_size=300,
                        special_tokens=("BOS", "EOS", "PAD"))
    with pytest.raises(UserError, match=r"'<\|eos\|>' is given as BOS.*order BOS,EOS,PAD"):
        train_tokenizer(_never_read(), tmp_path / "c.json", vocab_size=300,
                        special_tokens=("<|eos|>", "<|bos|>", "<|pad|>"))
    assert list(tmp_path.iterdir()) == []


def test_custom_special_names_in_tokenizer_json_are_the_roles_given(tmp_path):
    path = tmp_path / "c" / "tokenizer.json"
    tok = train_tokenizer(DOCS, path, vocab_size=300, special_tokens=("BOS", "EOS", "PAD"))
    again = load_tokenizer(path.parent)
    for loaded in (tok, again):
        assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 2)
        assert loaded.decode([loaded.eos_id]) == "EOS"
    config = json.loads((path.parent / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("BOS", "EOS", "PAD")
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokenizer.json",
                                                            "tokenizer_config.json"]


def test_sidecar_is_written_only_for_tokenizer_json_and_used_only_when_it_matches(tmp_path):
    a = train_tokenizer(DOCS, tmp_path / "x" / "a.json", vocab_size=300)
    b = train_tokenizer(DOCS, tmp_path / "x" / "b.json", vocab_size=300,
                        special_tokens=("<s>", "</s>", "<pad>"))
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["a.json", "b.json"]
    assert hf_config_path(a) is None
    stale = tmp_path / "x" / "tokenizer_config.json"  # as an older densetrain left it: b's
    stale.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    assert hf_config_path(load_tokenizer(a.path)) is None  # a has no "</s>"
    assert hf_config_path(load_tokenizer(b.path)) == stale
    c = train_tokenizer(DOCS, tmp_path / "y" / "tokenizer.json", vocab_size=300)
    assert hf_config_path(c) == tmp_path / "y" / "tokenizer_config.json"


def test_empty_corpus_names_the_inputs_and_the_skipped(tmp_path):
    for i in range(3):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"b{i}.bin").write_bytes(bytes(range(256)) * 10)
    stats = ReadStats()
    documents = iter_documents(expand_inputs([str(tmp_path / "in")]), stats=stats)
    with pytest.raises(UserError, match=r"corpus is empty: inputs .*b0\.bin, .*b1\.bin, .*b2\.bin "
                                        r"gave no documents \(3 binary files skipped\)"):
        train_tokenizer(documents, tmp_path / "t.json", vocab_size=300)
    assert not (tmp_path / "t.json").exists()


def test_prepare_copies_only_the_sidecar_that_describes_its_tokenizer(tmp_path):
    """The audit case: a directory of two tokenizers and one tokenizer_config.json written for
    the other; the dataset must not ship a config naming tokens its tokenizer lacks."""
    from densetrain.data.prepare import prepare_dataset

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(DOCS))
    a = train_tokenizer(DOCS, tmp_path / "x" / "a.json", vocab_size=300)
    stale = tmp_path / "x" / "tokenizer_config.json"
    stale.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    prepare_dataset([str(corpus)], tmp_path / "ds_a", tokenizer=a.path)
    assert not (tmp_path / "ds_a" / "tokenizer_config.json").exists()
    c = train_tokenizer(DOCS, tmp_path / "y" / "tokenizer.json", vocab_size=300,
                        special_tokens=("<s>", "</s>", "<pad>"))
    prepare_dataset([str(corpus)], tmp_path / "ds_c", tokenizer=c.path)
    copied = tmp_path / "ds_c" / "tokenizer_config.json"
    assert json.loads(copied.read_text())["eos_token"] == "</s>"
    assert load_tokenizer(tmp_path / "ds_c" / "tokenizer.json").eos_id == c.eos_id
