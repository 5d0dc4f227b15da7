"""Damaged or edited prepared datasets: a ``meta.json`` with missing or mistyped fields, and a
file given as a dataset directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from densetrain.cli.main import main
from densetrain.data import DataConfig, build_data
from densetrain.data.checks import data_vocabulary
from densetrain.data.inspect import inspect_dataset
from densetrain.data.shards import load_metadata, verify_dataset
from densetrain.errors import DamagedFileError


@pytest.fixture()
def dataset(prepared, tmp_path) -> Path:
    """A private copy of the shared small dataset (the tests damage it)."""
    return Path(shutil.copytree(prepared, tmp_path / "ds"))


def _edit(root: Path, change) -> None:
    path = root / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _train(meta):
    return meta["splits"]["train"]


EDITS = {
    "no-splits": (lambda m: m.pop("splits"), r"splits is missing, expected an object"),
    "no-file": (lambda m: _train(m)["shards"][0].pop("file"),
                r"splits\.train\.shards\[0\]\.file is missing, expected a relative path"),
    "no-head-sha": (lambda m: _train(m)["shards"][0].pop("head_sha256"),
                    r"splits\.train\.shards\[0\]\.head_sha256 is missing, expected a SHA-256"),
    "split-string": (lambda m: m["splits"].update(train="oops"),
                     r'splits\.train holds "oops" \(a string\), expected an object'),
    "dtype-foo": (lambda m: m.update(dtype="foo"),
                  r"dtype holds \"foo\" \(a string\), expected 'uint16' or 'uint32'"),
    "dtype-float": (lambda m: m.update(dtype="float32"), r"dtype holds \"float32\""),
    "tokens-text": (lambda m: _train(m)["shards"][0].update(num_tokens="lots"),
                    r"splits\.train\.shards\[0\]\.num_tokens holds \"lots\" \(a string\), "
                    r"expected an integer"),
    "split-total": (lambda m: _train(m).update(num_tokens=_train(m)["num_tokens"] + 1),
                    r"splits\.train\.num_tokens holds \d+ \(an integer\), expected \d+ \(the sum"),
    "outside-path": (lambda m: _train(m)["shards"][0].update(file="../../etc/passwd"),
                     r"splits\.train\.shards\[0\]\.file holds \"\.\./\.\./etc/passwd\""),
    "eos-null": (lambda m: m["tokenizer"].update(eos_id=None), r"tokenizer\.eos_id holds null"),
    "counts-int": (lambda m: m.update(counts=3), r"counts holds 3 \(an integer\), expected an"),
    "small-vocab": (lambda m: m["tokenizer"].update(vocab_size=100),
                    r"tokenizer\.vocab_size is 100 but splits\.\w+\.shards\[0\]\.max_token_id"),
    "not-object": (lambda m: m.update(splits=[]), r"splits holds \[\] \(an array\)"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_meta_json_fields_are_checked_and_named(dataset, name):
    change, expected = EDITS[name]
    _edit(dataset, change)
    with pytest.raises(DamagedFileError, match=r"ds/meta\.json: " + expected):
        load_metadata(dataset)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_edited_meta_json_is_one_user_error_on_the_command_line(dataset, capsys, command):
    _edit(dataset, lambda m: m.pop("splits"))
    assert main(["data", command, str(dataset)]) == 2
    err = capsys.readouterr().err
    assert "meta.json: splits is missing" in err and "internal error" not in err


def test_meta_vocab_size_other_than_its_tokenizers_is_named(dataset):
    ids = load_metadata(dataset)["tokenizer"]["vocab_size"]
    _edit(dataset, lambda m: m["tokenizer"].update(vocab_size=1000))
    load_metadata(dataset)  # consistent in itself: every shard's max id is below 1000
    pattern = rf"meta\.json: tokenizer\.vocab_size is 1000 but the dataset's tokenizer .* {ids} ids"
    for check in (lambda: data_vocabulary(DataConfig(datasets=[str(dataset)])),
                  lambda: build_data(DataConfig(datasets=[str(dataset)], seq_len=16)),
                  lambda: inspect_dataset(dataset), lambda: verify_dataset(dataset)):
        with pytest.raises(DamagedFileError, match=pattern):
            check()


def test_a_file_given_as_the_dataset_directory_is_called_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("not a dataset\n")
    for command in ("verify", "inspect"):
        assert main(["data", command, str(tmp_path / "afile")]) == 2
        err = capsys.readouterr().err
        assert "afile is a file, not a directory" in err and "does not exist" not in err
    with pytest.raises(OSError, match="is a file, not a directory"):
        data_vocabulary(DataConfig(datasets=[str(tmp_path / "afile")]))
