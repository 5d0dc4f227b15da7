"""Prepared datasets under ``s3://`` against a real local S3 server (moto, the ``s3`` fixture of
tests/conftest.py): training reads the same batches as from the local copy (and resumes the
same), a damaged shard object is refused, the cache bound evicts, `data prepare` uploads, and
bad URLs are one line naming them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from densetrain.data import DataConfig
from densetrain.data.checks import data_vocabulary
from densetrain.data.remote import RemoteDatasetError, ShardCache, open_remote_dataset
from densetrain.data.shards import META_FILE, TokenStore
from densetrain.errors import DamagedFileError

_MISSING = [m for m in ("s3fs", "moto") if importlib.util.find_spec(m) is None]
needs_s3 = pytest.mark.skipif(
    bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (pip install -e '.[dev]')")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache directory (``DENSETRAIN_CACHE``: also where `data prepare` stages)."""
    where = tmp_path / "cache"
    monkeypatch.setenv("DENSETRAIN_CACHE", str(where))
    return where


def _upload(s3, local: Path, prefix: str) -> None:
    """Every file of ``local`` under ``prefix``, ``meta.json`` last (as `data prepare` does)."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    for path in sorted(files, key=lambda p: p.name == META_FILE):
        s3.put_file(str(path), f"{prefix}/{path.relative_to(local).as_posix()}")


@pytest.fixture
def remote(s3, prepared) -> str:
    s3.mkdir("data")
    _upload(s3, prepared, "data/ds")
    return "s3://data/ds"


def _job(tmp_path, cache, dataset: str, run: str, *extra: str):
    from densetrain.config import load_job_config
    from densetrain.testing import tiny_job_overrides

    return load_job_config(None, tiny_job_overrides(
        cache_dir=str(cache), run_dir=str(tmp_path / run), extra=[
            f"--data.datasets={dataset}", "--training.steps=6", "--eval.interval=0",
            "--eval.sample_tokens=0", "--checkpoint.interval=3", "--checkpoint.keep_last=0",
            *extra]))


def _losses(run_dir) -> list[tuple]:
    from densetrain.train import read_metrics

    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


@needs_s3
def test_training_from_s3_is_exact_and_resumes_exactly(tmp_path, cache, prepared,
                                                       remote) -> None:
    from densetrain.testing.callbacks import InterruptAfter
    from densetrain.train import train

    local = _job(tmp_path, cache, str(prepared), "local")
    train(local)
    # a cache of two shards: every step evicts and fetches again, in the background too
    small = _job(tmp_path, cache, remote, "s3", "--data.cache_max_bytes=20000")
    with pytest.raises(KeyboardInterrupt):
        train(small, callbacks=[InterruptAfter(at=3)])
    summary = train(small)
    assert summary["resumed_from"].endswith("step-00000003")
    assert _losses(small.logging.run_dir) == _losses(local.logging.run_dir)  # bit for bit
    shards = list((cache / "remote").glob("shards-rank*/*"))
    assert shards and all(p.suffix == ".bin" for p in shards)  # no temporary file left
    assert sum(p.stat().st_size for p in shards) <= 20000


@needs_s3
def test_a_shard_with_flipped_bytes_is_refused_naming_it(s3, cache, remote) -> None:
    name = "train/00001.bin"
    data = bytearray(s3.cat_file(f"data/ds/{name}"))
    data[100] ^= 0xFF  # past nothing: the whole shard is hashed on fetch
    s3.pipe_file(f"data/ds/{name}", bytes(data))
    dataset = open_remote_dataset(remote, cache_dir=str(cache))
    store = TokenStore(dataset.root, "train", dataset.meta, remote=dataset.split("train"))
    with pytest.raises(DamagedFileError, match=f"shard {name} of dataset {remote}") as caught:
        store.read(0, store.num_tokens)
    assert "refused" in str(caught.value) and "\n" not in str(caught.value)
    assert sorted(p.name for p in dataset.cache.directory.iterdir()) == [
        f"{dataset.meta['splits']['train']['shards'][0]['sha256']}.bin"]  # only the good one


@needs_s3
def test_the_cache_bound_evicts_least_recently_used_and_fetches_again(cache, remote) -> None:
    dataset = open_remote_dataset(remote, cache_dir=str(cache))
    split = dataset.split("train")
    sizes = [s.nbytes for s in split.shards[:3]]
    bound = 2 * max(sizes)
    assert sum(sizes) > bound  # two shards fit, three do not
    shards = ShardCache(cache / "bounded", max_bytes=bound)
    split.cache = shards
    expected = [bytes(split.array(i)) for i in range(3)]  # the third evicts the first
    assert shards.fetches == 3 and shards.used_bytes <= bound
    assert shards.cached() == {split.shards[1].sha256, split.shards[2].sha256}
    split.array(1)  # now 2 is the least recently used
    assert bytes(split.array(0)) == expected[0] and shards.fetches == 4
    assert shards.cached() == {split.shards[0].sha256, split.shards[1].sha256}
    split.prefetch([2])  # in the background; the read waits for it
    assert bytes(split.array(2)) == expected[2] and shards.fetches == 5
    again = ShardCache(cache / "bounded", max_bytes=bound)  # a later process
    assert again.cached() == shards.cached()


@needs_s3
def test_prepare_to_s3_then_train_from_it(s3, tmp_path, cache, corpus_docs,
                                          tokenizer_path) -> None:
    from data_helpers import write_text_files

    from densetrain.cli.main import main
    from densetrain.train import train

    write_text_files(tmp_path / "raw", corpus_docs)
    s3.mkdir("data")
    argv = ["data", "prepare", str(tmp_path / "raw"), "--tokenizer", str(tokenizer_path),
            "--shard-tokens", "4000", "--val-fraction", "0.1", "-o", "s3://data/prepared"]
    assert main(argv) == 0
    s3.invalidate_cache()
    names = {p.rsplit("/", 1)[1] for p in s3.ls("data/prepared")}
    assert {META_FILE, "train", "tokenizer.json"} <= names
    assert not list((cache / "remote" / "prepare").iterdir())  # the staging copy is gone
    assert main(argv) == 2  # a complete dataset there is not replaced without --overwrite
    job = _job(tmp_path, cache, "s3://data/prepared", "run", "--training.steps=3",
               "--schedule.warmup_steps=1")
    train(job)
    assert [step for step, _, _ in _losses(job.logging.run_dir)] == [1, 2, 3]


@needs_s3
@pytest.mark.parametrize(("url", "says"), [
    ("s3:///ds", "names no bucket"),
    ("nosuchscheme://b/ds", "no filesystem"),
    ("s3://no-such-bucket/ds", "bucket 'no-such-bucket' does not exist"),
    ("s3://data/empty", "holds no meta.json"),
])
def test_bad_dataset_urls_are_one_line_naming_them(s3, cache, url, says) -> None:
    s3.mkdir("data")
    s3.pipe_file("data/empty/train/00000.bin", b"\0\0")
    cfg = DataConfig(datasets=[url], cache_dir=str(cache))
    with pytest.raises(ValueError, match=says) as caught:
        cfg.validate()
        data_vocabulary(cfg)  # what `densetrain train` checks before any step
    assert url in str(caught.value) and "\n" not in str(caught.value)


def test_missing_package_names_the_extra(monkeypatch, cache) -> None:
    import fsspec

    def refuse(protocol):
        raise ImportError("Install s3fs to access S3", name="s3fs")

    monkeypatch.setattr(fsspec, "get_filesystem_class", refuse)
    with pytest.raises(ValueError, match=r"pip install 'densetrain\[s3\]'") as caught:
        DataConfig(datasets=["s3://bucket/ds"]).validate()
    assert "data.datasets[0]='s3://bucket/ds'" in str(caught.value)
    with pytest.raises(RemoteDatasetError, match=r"s3://bucket/ds.*densetrain\[s3\]"):
        open_remote_dataset("s3://bucket/ds", cache_dir=str(cache))
