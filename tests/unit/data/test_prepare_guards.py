"""prepare's guards: what --overwrite may remove, what a failed run leaves, edge values, and
messages that name the command line's flags."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from data_helpers import synthetic_documents, write_text_files

from densetrain.cli.main import main
from densetrain.data import PrepareConfig, load_metadata, prepare_dataset
from densetrain.data.scaleout import prepare_dataset_distributed, prepare_dataset_parallel
from densetrain.data.shards import verify_dataset
from densetrain.errors import UserError
from densetrain.testing import run_distributed


@pytest.fixture
def raw(tmp_path):
    """40 small text documents."""
    write_text_files(tmp_path / "raw", synthetic_documents(40, seed=7))
    return tmp_path / "raw"


@pytest.fixture
def binary(tmp_path):
    """A directory whose only file is binary (reading skips it: no documents)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(bytes(range(256)) * 80)
    return tmp_path / "bin"


@pytest.fixture
def dataset(tmp_path, prepared):
    """A private copy of the session's prepared dataset (tests may try to replace it)."""
    shutil.copytree(prepared, tmp_path / "ds")
    return tmp_path / "ds"


def _prepare(capsys, inputs, out, tokenizer, *extra):
    code = main(["data", "prepare", *map(str, inputs), "-o", str(out), "--tokenizer",
                 str(tokenizer), *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def _snapshot(root):
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _hidden_siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


# --- 1. --overwrite removes only a dataset, and only once the new one is complete -------------


def test_overwrite_refuses_a_directory_that_is_not_a_dataset(tmp_path, raw, tokenizer_path,
                                                             capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("important")
    code, err = _prepare(capsys, [raw], precious, tokenizer_path, "--overwrite")
    assert code == 2 and str(precious) in err and "thesis.txt" in err, err
    assert "not a prepared dataset" in err
    assert (precious / "thesis.txt").read_text() == "important"


def test_overwrite_refuses_a_dataset_with_foreign_files(dataset, raw, tokenizer_path, capsys):
    (dataset / "notes.md").write_text("my notes")
    code, err = _prepare(capsys, [raw], dataset, tokenizer_path, "--overwrite")
    assert code == 2 and "notes.md" in err, err
    assert (dataset / "notes.md").read_text() == "my notes"
    verify_dataset(dataset)


def test_overwrite_checks_the_inputs_before_touching_the_dataset(dataset, tmp_path,
                                                                 tokenizer_path, capsys):
    before = _snapshot(dataset)
    code, err = _prepare(capsys, [tmp_path / "typo_input"], dataset, tokenizer_path,
                         "--overwrite")
    assert code == 2 and "typo_input" in err and "does not exist" in err, err
    assert _snapshot(dataset) == before


def test_overwrite_that_fails_on_its_input_leaves_the_old_dataset(dataset, binary,
                                                                  tokenizer_path, capsys):
    before = _snapshot(dataset)
    code, err = _prepare(capsys, [binary], dataset, tokenizer_path, "--overwrite")
    assert code == 2 and "contain no documents" in err and "1 binary files skipped" in err, err
    assert _snapshot(dataset) == before
    assert _hidden_siblings(dataset) == []  # the half-built replacement is gone too


def test_overwrite_replaces_the_dataset_even_with_its_own_tokenizer(dataset, raw, capsys):
    old_meta = load_metadata(dataset)
    code, err = _prepare(capsys, [raw], dataset, dataset / "tokenizer.json", "--overwrite",
                         "--val-fraction", "0.3")
    assert code == 0, err
    meta = load_metadata(dataset)
    assert meta["settings"]["val_fraction"] == 0.3 != old_meta["settings"]["val_fraction"]
    assert meta["counts"]["read"]["documents"] == 40
    assert meta["tokenizer"]["fingerprint"] == old_meta["tokenizer"]["fingerprint"]
    verify_dataset(dataset)
    assert _hidden_siblings(dataset) == []


def test_overwrite_stopped_early_keeps_the_old_dataset_and_resumes(dataset, raw, tmp_path,
                                                                   tokenizer_path):
    before = _snapshot(dataset)
    cfg = PrepareConfig(val_fraction=0.2, shard_tokens=500, batch_bytes=500, exact_dedup=True)
    assert prepare_dataset([str(raw)], dataset, tokenizer=tokenizer_path, cfg=cfg,
                           overwrite=True, max_shards=2) is None
    assert _snapshot(dataset) == before  # still the old, complete dataset
    meta = prepare_dataset([str(raw)], dataset, tokenizer=tokenizer_path, cfg=cfg,
                           overwrite=True)  # the same call again: continues, then swaps
    fresh = prepare_dataset([str(raw)], tmp_path / "fresh", tokenizer=tokenizer_path, cfg=cfg)
    assert meta["splits"] == fresh["splits"] and len(meta["splits"]["train"]["shards"]) > 2
    verify_dataset(dataset)
    assert _hidden_siblings(dataset) == []


def test_overwrite_with_workers_that_fails_leaves_the_old_dataset(dataset, tmp_path,
                                                                  tokenizer_path, capsys):
    before = _snapshot(dataset)
    (tmp_path / "jl").mkdir()
    (tmp_path / "jl" / "a.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    code, err = _prepare(capsys, [tmp_path / "jl"], dataset, tokenizer_path, "--overwrite",
                         "--workers", "2")
    assert code == 2 and "a.jsonl:2" in err, err
    assert _snapshot(dataset) == before and _hidden_siblings(dataset) == []


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_output_that_is_a_file_is_one_clear_error(tmp_path, raw, tokenizer_path, capsys,
                                                  overwrite):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    code, err = _prepare(capsys, [raw], afile, tokenizer_path, *overwrite)
    assert code == 2 and f"{afile} is a file, not a directory" in err, err
    assert "Errno" not in err and afile.read_text() == "keep me"


# --- 11. a run that failed on its input leaves no resume state ------------------------------


@pytest.mark.parametrize("failing", ["binary", "filtered"])
def test_failed_prepare_leaves_nothing_that_blocks_the_next_run(failing, tmp_path, raw, binary,
                                                                tokenizer_path, capsys):
    out = tmp_path / "d2"
    if failing == "binary":
        code, err = _prepare(capsys, [binary], out, tokenizer_path)
        assert code == 2 and "contain no documents" in err, err
    else:
        write_text_files(tmp_path / "short", ["too short"] * 5)
        code, err = _prepare(capsys, [tmp_path / "short"], out, tokenizer_path,
                             "--quality-filter")
        assert code == 2 and "survived filtering" in err, err
    assert not out.exists()
    code, err = _prepare(capsys, [raw], out, tokenizer_path)
    assert code == 0, err
    verify_dataset(out)


def test_failed_prepare_into_an_empty_directory_keeps_the_directory(tmp_path, binary,
                                                                    tokenizer_path):
    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(UserError, match="contain no documents"):
        prepare_dataset([str(binary)], out, tokenizer=tokenizer_path)
    assert out.is_dir() and list(out.iterdir()) == []


def test_malformed_line_in_a_worker_removes_the_work_and_says_no_resume(tmp_path, raw,
                                                                        tokenizer_path, capsys):
    (tmp_path / "jl").mkdir()
    for i in range(3):
        lines = [json.dumps({"text": doc}) for doc in synthetic_documents(4, seed=i)]
        (tmp_path / "jl" / f"p{i}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "jl" / "p2.jsonl").write_text('{"text": broken\n')
    out = tmp_path / "out"
    code, err = _prepare(capsys, [tmp_path / "jl"], out, tokenizer_path, "--workers", "2")
    assert code == 2 and "p2.jsonl:1" in err and "resume" not in err, err
    assert not out.exists()
    (tmp_path / "jl" / "p2.jsonl").write_text(json.dumps({"text": "now fine"}) + "\n")
    code, err = _prepare(capsys, [tmp_path / "jl"], out, tokenizer_path, "--workers", "2")
    assert code == 0, err
    assert load_metadata(out)["counts"]["read"]["documents"] == 9


def test_all_filtered_with_workers_removes_the_work(tmp_path, tokenizer_path):
    write_text_files(tmp_path / "raw", ["too short"] * 4)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="survived filtering"):
        prepare_dataset_parallel([str(tmp_path / "raw")], tmp_path / "out",
                                 tokenizer=tokenizer_path, workers=2,
                                 cfg=PrepareConfig(quality_filter=True))
    assert list((tmp_path / "out").iterdir()) == []


def _distributed_bad_line(rank: int, world: int, raw: str, out: str, tokenizer: str) -> str:
    try:
        prepare_dataset_distributed([raw], out, tokenizer=tokenizer)
    except UserError as error:
        return str(error)
    return "no error"


def test_malformed_line_on_a_rank_removes_the_work(tmp_path, tokenizer_path):
    (tmp_path / "jl").mkdir()
    (tmp_path / "jl" / "a.jsonl").write_text(json.dumps({"text": "fine document"}) + "\n")
    (tmp_path / "jl" / "b.jsonl").write_text('{"text": broken\n')
    out = tmp_path / "out"
    messages = run_distributed(_distributed_bad_line, 2, str(tmp_path / "jl"), str(out),
                               str(tokenizer_path))
    for message in messages:
        assert "b.jsonl:1" in message and "resume" not in message, message
    assert not out.exists()


# --- 12. edge values --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "0"])
def test_max_shards_below_one_is_refused(value, tmp_path, raw, tokenizer_path, capsys):
    code, err = _prepare(capsys, [raw], tmp_path / "o", tokenizer_path, "--max-shards", value)
    assert code == 2 and "--max-shards must be >= 1" in err and value in err, err
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="max_shards must be >= 0"):
        prepare_dataset([str(raw)], tmp_path / "o", tokenizer=tokenizer_path, max_shards=-1)


def test_val_fraction_that_leaves_train_empty_is_refused(tmp_path, raw, tokenizer_path,
                                                         capsys):
    out = tmp_path / "o"
    code, err = _prepare(capsys, [raw], out, tokenizer_path, "--val-fraction", "0.999")
    assert code == 2 and "--val-fraction 0.999" in err and "all 40 kept documents" in err, err
    assert "none in train" in err and not out.exists()


# --- 13. messages name the flags ----------------------------------------------------------------


@pytest.mark.parametrize("extra, expected", [
    (["--val-fraction", "1.0"], "--val-fraction must be in [0, 1)"),
    (["--shard-tokens", "0"], "--shard-tokens must be >= 1"),
    (["--bands", "0"], "--num-perm (128) must be a positive multiple of --bands (0)"),
    (["--num-perm", "100"], "--num-perm (100) must be a positive multiple of --bands (16)"),
    (["--shingle-size", "0"], "--shingle-size must be >= 1"),
    (["--threshold", "1.5"], "--threshold must be in (0, 1]"),
])
def test_bad_values_are_named_by_their_flag(extra, expected, tmp_path, raw, tokenizer_path,
                                           capsys):
    code, err = _prepare(capsys, [raw], tmp_path / "o", tokenizer_path, *extra)
    assert code == 2 and expected in err, err
    assert "_" not in err.split("error:", 1)[1].replace(str(tmp_path), ""), err


@pytest.mark.parametrize("command", ["prepare", "train-tokenizer"])
def test_bad_text_separator_escape_names_the_flag(command, tmp_path, raw, tokenizer_path,
                                                  capsys):
    tail = (["--tokenizer", str(tokenizer_path)] if command == "prepare"
            else ["--vocab-size", "300"])
    code = main(["data", command, str(raw), "-o", str(tmp_path / "o"), "--text-separator",
                 "\\x", *tail])
    err = capsys.readouterr().err
    assert code == 2 and "--text-separator '\\x'" in err and "\\xHH" in err, err
    assert "codec" not in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_non_ascii_text_separator_splits_documents(tmp_path, tokenizer_path, capsys):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("first part§second part§third part")
    code, err = _prepare(capsys, [tmp_path / "t"], tmp_path / "o", tokenizer_path,
                         "--text-separator", "§")
    assert code == 0, err
    assert load_metadata(tmp_path / "o")["counts"]["read"]["documents"] == 3


# --- train-tokenizer: an empty corpus says what reading skipped ---------------------------------


def test_tokenizer_on_binary_files_says_what_was_skipped(tmp_path, binary, capsys):
    code = main(["data", "train-tokenizer", str(binary), "-o", str(tmp_path / "t.json"),
                 "--vocab-size", "300"])
    err = capsys.readouterr().err
    assert code == 2 and "empty" in err and "1 binary files skipped" in err, err
    assert not os.path.exists(tmp_path / "t.json")


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)])
def test_train_tokenizer_output_that_is_a_directory_names_the_file_to_give(raw, tmp_path, capsys,
                                                                           overwrite):
    (tmp_path / "tokdir").mkdir()
    code = main(["data", "train-tokenizer", str(raw), "-o", str(tmp_path / "tokdir"),
                 "--vocab-size", "300", *overwrite])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "is a directory" in err and "tokdir/tokenizer.json" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["raw", "tokdir"])
