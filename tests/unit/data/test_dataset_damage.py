"""Damaged or edited prepared datasets: token ids outside the vocabulary (flipped bytes past the
part of a shard checked on open), a ``meta.json`` with missing or mistyped fields, a file given
as a dataset directory, and a resume after the dataset was prepared again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from data_helpers import synthetic_documents, write_text_files

from densetrain.cli.main import main
from densetrain.data import DataConfig, PrepareConfig, TokenStore, build_data, prepare_dataset
from densetrain.data.checks import data_vocabulary
from densetrain.data.inspect import inspect_dataset
from densetrain.data.shards import HEAD_BYTES, load_metadata, verify_dataset
from densetrain.data.stream import BatchStream, DataStateMismatchError
from densetrain.errors import DamagedFileError
from densetrain.testing import TINY_OVERRIDES


@pytest.fixture(scope="module")
def big(tmp_path_factory, tokenizer_path) -> Path:
    """A dataset whose first train shard is well past the 64 KiB checked on open."""
    root = tmp_path_factory.mktemp("big")
    write_text_files(root / "raw", synthetic_documents(800, seed=3))
    cfg = PrepareConfig(val_fraction=0.05, shard_tokens=1 << 20, batch_bytes=1 << 20)
    prepare_dataset([str(root / "raw")], root / "ds", tokenizer=tokenizer_path, cfg=cfg)
    return root / "ds"


@pytest.fixture()
def dataset(prepared, tmp_path) -> Path:
    """A private copy of the shared small dataset (the tests damage it)."""
    return Path(shutil.copytree(prepared, tmp_path / "ds"))


def _flip(root: Path, positions) -> Path:
    """Flip the top bit of the uint16 tokens at ``positions`` of the first train shard."""
    shard = root / load_metadata(root)["splits"]["train"]["shards"][0]["file"]
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    assert len(tokens) * 2 > HEAD_BYTES + 20_000
    tokens[positions] ^= 0x8000
    tokens.flush()
    del tokens
    return shard


def test_flipped_id_past_the_head_is_refused_where_the_batch_is_built(big, tmp_path):
    root = Path(shutil.copytree(big, tmp_path / "flip"))
    position = HEAD_BYTES // 2 + 7_000  # a token past the bytes the open-time check hashes
    _flip(root, [position])
    store = TokenStore(root, "train")  # opens: size and first 64 KiB still match
    stream = BatchStream([store], [1.0], seq_len=64, seed=0)
    with pytest.raises(DamagedFileError) as caught:
        stream.batch_at(0, stream.num_sequences[0])  # every sequence of the epoch
    message = str(caught.value)
    assert "train/00000.bin" in message and f"token offset {position} " in message
    assert f"vocabulary of {store.vocab_size} ids" in message
    assert f"densetrain data verify {root}" in message


def test_train_on_flipped_bytes_names_the_shard_not_an_index_error(big, tmp_path, capsys):
    root = Path(shutil.copytree(big, tmp_path / "flip"))
    _flip(root, slice(HEAD_BYTES // 2, None, 10))
    code = main(["train", *TINY_OVERRIDES, f'--data.datasets=["{root}"]', "--training.steps=2",
                 "--eval.interval=0", "--eval.sample_tokens=0", "--checkpoint.enabled=false",
                 "--schedule.warmup_steps=0",
                 f"--logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "internal error" not in err and "IndexError" not in err
    assert "00000.bin" in err and "token offset" in err and "densetrain data verify" in err


def test_inspect_reports_ids_outside_the_vocabulary(big, tmp_path, capsys):
    root = Path(shutil.copytree(big, tmp_path / "flip"))
    positions = np.arange(HEAD_BYTES // 2 + 100, HEAD_BYTES // 2 + 1100, 10)
    _flip(root, positions)
    with pytest.raises(DamagedFileError) as caught:
        inspect_dataset(root)
    message = str(caught.value)
    assert f"token offset {positions[0]} " in message and "(100 such ids" in message
    assert main(["data", "inspect", str(root)]) == 2
    assert "densetrain data verify" in capsys.readouterr().err


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


def _prepare(docs: list[str], root: Path, tokenizer_path: Path, raw_name: str,
             overwrite: bool = False) -> None:
    """Write ``docs`` as text files beside ``root`` and prepare ``root`` from them."""
    raw = root.parent / raw_name
    write_text_files(raw, docs)
    prepare_dataset([str(raw)], root, tokenizer=tokenizer_path, overwrite=overwrite,
                    cfg=PrepareConfig(val_fraction=0.1, shard_tokens=4000, batch_bytes=4000))


def _train_args(dataset: Path, run: Path) -> list[str]:
    """``densetrain train`` of the tiny model on ``dataset`` into ``run``, a checkpoint every
    2 steps (``--training.steps`` to add)."""
    return ["train", *TINY_OVERRIDES, f'--data.datasets=["{dataset}"]', "--eval.interval=0",
            "--eval.sample_tokens=0", "--checkpoint.interval=2", "--schedule.warmup_steps=0",
            f"--logging.run_dir={run}"]


def _prepare_again(root: Path, tokenizer_path: Path, seed: int, count: int) -> None:
    _prepare(synthetic_documents(count, seed=seed), root, tokenizer_path, f"raw{seed}",
             overwrite=True)


def test_stream_state_of_a_changed_dataset_names_it_and_the_counts(prepared, tmp_path,
                                                                   tokenizer_path):
    other = Path(shutil.copytree(prepared, tmp_path / "other"))

    def stream() -> BatchStream:
        stores = [TokenStore(prepared, "train"), TokenStore(other, "train")]
        return BatchStream(stores, [1.0, 1.0], seq_len=16, seed=1)

    state = stream().state_dict()
    before = stream().num_sequences[1]
    _prepare_again(other, tokenizer_path, seed=9, count=60)
    changed = stream()
    with pytest.raises(DataStateMismatchError) as caught:
        changed.load_state_dict(state)
    message = str(caught.value)
    assert f"dataset {other} held {before} sequences of 16 tokens" in message
    assert f"holds {changed.num_sequences[1]} now" in message and str(prepared) + " " not in message
    assert "changed since the checkpoint" in message and "--checkpoint.resume=false" in message
    assert "'" not in message


def test_resume_after_the_dataset_is_prepared_again_names_checkpoint_and_dataset(
        dataset, tmp_path, tokenizer_path, capsys):
    args = _train_args(dataset, tmp_path / "run")
    assert main([*args, "--training.steps=2"]) == 0
    _prepare_again(dataset, tokenizer_path, seed=9, count=60)
    capsys.readouterr()
    assert main([*args, "--training.steps=4"]) == 2
    err = capsys.readouterr().err
    assert "step-00000002 (step 2)" in err and f"dataset {dataset} held" in err
    assert "changed since the checkpoint" in err and "--checkpoint.resume=false" in err
    assert "num_sequences='" not in err and "internal error" not in err


def _reorder(root: Path, tokenizer_path: Path, docs: list[str]) -> None:
    """Prepare ``root`` again from the same documents in reverse order: the same tokens in all
    (the split goes by each document's hash), so the same sequence count, in another order."""
    _prepare(list(reversed(docs)), root, tokenizer_path, "raw-reversed", overwrite=True)


def test_a_dataset_prepared_again_with_the_same_sequence_count_is_told_apart(tmp_path,
                                                                            tokenizer_path):
    docs = synthetic_documents(60, seed=4)
    root = tmp_path / "ds"
    _prepare(docs, root, tokenizer_path, "raw")

    def stream() -> BatchStream:
        return BatchStream([TokenStore(root, "train")], [1.0], seq_len=16, seed=1)

    before = stream()
    state = before.state_dict()
    first = before.batch_at(0, 4).inputs
    _reorder(root, tokenizer_path, docs)
    after = stream()
    assert after.num_sequences == before.num_sequences  # the old check could not see it
    assert not np.array_equal(after.batch_at(0, 4).inputs.numpy(), first.numpy())
    with pytest.raises(DataStateMismatchError, match=f"dataset {root} holds other tokens than "
                                                     "when the checkpoint was saved"):
        after.load_state_dict(state)
    # A state saved before contents were recorded is still accepted on the rest.
    legacy = {k: v for k, v in state.items() if k != "content"}
    after.load_state_dict(legacy)
    assert after.consumed_sequences == state["consumed_sequences"]


def test_resume_after_a_reorder_of_the_same_documents_is_refused(tmp_path, tokenizer_path,
                                                                capsys):
    docs = synthetic_documents(60, seed=5)
    dataset = tmp_path / "ds"
    _prepare(docs, dataset, tokenizer_path, "raw")
    args = _train_args(dataset, tmp_path / "run")
    assert main([*args, "--training.steps=2"]) == 0
    _reorder(dataset, tokenizer_path, docs)
    capsys.readouterr()
    assert main([*args, "--training.steps=4"]) == 2
    err = capsys.readouterr().err
    assert "step-00000002 (step 2)" in err and f"dataset {dataset} holds other tokens" in err
    assert "--checkpoint.resume=false" in err and "Traceback" not in err


def test_a_checkpoint_saved_before_contents_were_recorded_still_resumes_exactly(
        dataset, tmp_path, monkeypatch):
    from densetrain.train import read_metrics

    def args(run: Path, steps: int) -> list[str]:
        return [*_train_args(dataset, run), f"--training.steps={steps}"]

    assert main(args(tmp_path / "now", 2)) == 0  # the reference: saved and resumed as now
    assert main(args(tmp_path / "now", 4)) == 0
    identity = BatchStream._identity
    with monkeypatch.context() as patch:  # the data state as older checkpoints hold it
        patch.setattr(BatchStream, "_identity", lambda self: {
            k: v for k, v in identity(self).items() if k != "content"})
        assert main(args(tmp_path / "old", 2)) == 0
    assert main(args(tmp_path / "old", 4)) == 0
    losses = [[r["loss"] for r in read_metrics(tmp_path / name)] for name in ("now", "old")]
    assert losses[0] == losses[1] and len(losses[0]) == 4
