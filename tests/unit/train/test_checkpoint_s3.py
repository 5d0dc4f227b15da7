"""Checkpoints under ``s3://`` against a real local S3 server (moto's standalone server): config
refusals, save and bit-exact resume through `train`, a damaged newest checkpoint skipped."""

from __future__ import annotations

import importlib.util

import pytest

from densetrain.checkpoint import list_checkpoints
from densetrain.checkpoint.objstore import ObjectStoreError, url_problem
from densetrain.testing.callbacks import InterruptAfter
from densetrain.train import read_metrics, train

_MISSING = [m for m in ("s3fs", "moto") if importlib.util.find_spec(m) is None]
needs_s3 = pytest.mark.skipif(
    bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (pip install -e '.[dev]')")


def test_url_problems_are_one_line_naming_the_field() -> None:
    assert url_problem("checkpoint.dir", "/local/dir") is None
    assert url_problem("checkpoint.dir", "file:///abs/dir") is None
    assert "absolute path" in url_problem("checkpoint.dir", "file://rel/dir")
    assert "names no bucket" in url_problem("checkpoint.dir", "s3:///prefix")
    assert "no filesystem" in url_problem("checkpoint.dir", "nosuchscheme://b/p")


def test_missing_package_names_the_url_and_the_extra(monkeypatch) -> None:
    import fsspec

    def refuse(protocol):
        raise ImportError("Install s3fs to access S3", name="s3fs")

    monkeypatch.setattr(fsspec, "get_filesystem_class", refuse)
    problem = url_problem("checkpoint.dir", "s3://bucket/run")
    assert "checkpoint.dir='s3://bucket/run'" in problem
    assert "pip install 'densetrain[s3]'" in problem and "\n" not in problem


def test_file_url_is_the_local_directory(make_job, tmp_path) -> None:
    where = tmp_path / "ckpts"
    job = make_job("--training.steps=4", "--checkpoint.interval=4", "--eval.interval=0",
                   "--eval.sample_tokens=0", f"--checkpoint.dir=file://{where}")
    train(job)
    assert [s for s, _ in list_checkpoints(where)] == [4]


_STEPS = ["--training.steps=6", "--checkpoint.interval=2", "--eval.interval=0",
          "--eval.sample_tokens=0", "--checkpoint.keep_last=0"]


def _curve(run_dir: str) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(run_dir)]


@needs_s3
def test_save_and_resume_on_s3_is_bit_exact(make_job, s3) -> None:
    reference = make_job(*_STEPS, run="straight")
    train(reference)
    job = make_job(*_STEPS, "--checkpoint.dir=s3://ckpt/run", "--checkpoint.async_save=false",
                   run="interrupted")  # the synchronous save (test_checkpoint_s3_readers: async)
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[InterruptAfter(at=4)])
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [2, 4]
    names = {p.rsplit("/", 1)[1] for p in s3.ls("ckpt/run/step-00000004")}
    assert {".metadata", "config.toml", "manifest.json"} <= names  # no .tmp prefix anywhere
    assert not [p for p in s3.ls("ckpt/run") if ".tmp" in p]
    resumed = train(job)
    assert resumed["resumed_from"] == "s3://ckpt/run/step-00000004"
    assert _curve(job.logging.run_dir) == _curve(reference.logging.run_dir)  # bit for bit
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [2, 4, 6]


@needs_s3
@pytest.mark.parametrize("damage", ["delete a shard", "garbage manifest"])
def test_damaged_newest_s3_checkpoint_is_named_and_skipped(make_job, s3, capsys,
                                                           damage) -> None:
    reference = make_job(*_STEPS, run="straight")
    train(reference)
    job = make_job(*_STEPS, "--checkpoint.dir=s3://ckpt/run", run="damaged")
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[InterruptAfter(at=4)])
    newest = "ckpt/run/step-00000004"
    if damage == "delete a shard":
        s3.rm_file(next(p for p in s3.ls(newest) if p.endswith(".distcp")))
    else:
        s3.pipe_file(f"{newest}/manifest.json", b"{not json")
    s3.invalidate_cache()
    capsys.readouterr()
    resumed = train(job)
    err = capsys.readouterr().err
    assert "checkpoint s3://ckpt/run/step-00000004 is damaged or partial" in err
    assert ("missing" if damage == "delete a shard" else "manifest.json: unreadable") in err
    assert resumed["resumed_from"] == "s3://ckpt/run/step-00000002"
    assert _curve(job.logging.run_dir)[-1] == _curve(reference.logging.run_dir)[-1]
    # The damaged step-4 was written again by the resumed run: it verifies now.
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [2, 4, 6]


@needs_s3
def test_missing_bucket_is_one_error_before_any_step(make_job, s3) -> None:
    job = make_job(*_STEPS, "--checkpoint.dir=s3://no-such-bucket/run", run="nobucket")
    with pytest.raises(ObjectStoreError, match=r"s3://no-such-bucket/run.*does not exist"):
        train(job)
    assert not read_metrics(job.logging.run_dir)
