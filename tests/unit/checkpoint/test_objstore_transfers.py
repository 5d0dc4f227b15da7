"""A checkpoint on an object store costs one transfer: a save sends each object once and reads
none back; a load fetches each block of a shard once.

Against a real local S3 server (moto's standalone server, the ``s3`` fixture). A save hashes
what it sends; the manifest must equal the SHA-256 of the objects as stored (hashed here
independently from ``cat_file``), and an object changed in the store before the manifest is
written fails the save, naming it. DCP's writer
stores tensors largest first and its reader reads them in the model's order, each through
``torch.load`` on a slice (its zip directory at the end first); through s3fs's default
read-ahead cache that fetched blocks several times (2.9x the shard for a 247 MB checkpoint in
benchmarks/RESULTS.md). The block sizes are scaled down here (256 KiB instead of 16 MiB for the
reader, and for s3fs's default) so that a 6 MB shard spans as many blocks as a large one does.
The bytes fetched are counted where s3fs fetches a range (``S3File._fetch_range``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from densetrain.checkpoint import (
    collective,
    load_checkpoint,
    objstore,
    safe_pickle,
    verify_checkpoint,
)
from densetrain.checkpoint.manager import CheckpointError

_MISSING = [m for m in ("s3fs", "moto") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (pip install -e '.[dev]')")

_BLOCK = 256 * 1024


def _tree(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of mixed sizes in an order unlike the writer's (largest first)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [3_000, 200_000, 50_000, 400_000, 10_000, 300_000, 120_000, 90_000, 250_000, 7_000]
    return {f"t{i:02d}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def _fetched(monkeypatch) -> list[int]:
    import s3fs.core

    counted: list[int] = []
    real = s3fs.core.S3File._fetch_range

    def fetch(self, start, end):
        data = real(self, start, end)
        counted.append(len(data))
        return data

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", fetch)
    return counted


def test_a_load_fetches_each_block_of_the_shard_once(s3, monkeypatch) -> None:
    import s3fs

    saved = _tree(0)
    path = objstore.save("s3://ckpt/run", 1, {"model": saved}, config_toml="x = 1\n",
                         keep_last=0)
    shard_bytes = sum(entry["size"] for entry in s3.ls(path[len("s3://"):], detail=True)
                      if entry["name"].endswith(".distcp"))
    assert shard_bytes > 20 * _BLOCK  # the shard spans many blocks
    # (after the save: s3fs writes in parts of at least 5 MB)
    monkeypatch.setattr(safe_pickle, "REMOTE_READ_BLOCK_BYTES", _BLOCK)
    monkeypatch.setattr(s3fs.S3FileSystem, "default_block_size", _BLOCK)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    counted = _fetched(monkeypatch)
    load_checkpoint(path, loaded, verify=False)
    for name, tensor in saved.items():
        assert torch.equal(loaded["model"][name], tensor), name
    fetched = sum(counted)
    # Every byte of the shard is needed once; the rest is the metadata objects and the last,
    # partial block of a range.
    assert shard_bytes <= fetched <= 1.1 * shard_bytes, (fetched, shard_bytes)


def test_a_save_reads_nothing_back_and_its_manifest_is_what_is_stored(s3, monkeypatch) -> None:
    counted = _fetched(monkeypatch)
    path = objstore.save("s3://ckpt/run", 3, {"model": _tree(1)}, config_toml="x = 1\n",
                         keep_last=0)
    assert sum(counted) == 0  # no object read back to be hashed
    manifest = json.loads(s3.cat_file(f"{path[len('s3://'):]}/manifest.json"))
    stored = {entry["name"].rsplit("/", 1)[1]: entry["size"]
              for entry in s3.ls(path[len("s3://"):], detail=True)}
    assert set(manifest["files"]) == set(stored) - {"manifest.json"}
    assert any(name.endswith(".distcp") for name in manifest["files"])
    for name, entry in manifest["files"].items():
        data = s3.cat_file(f"{path[len('s3://'):]}/{name}")
        assert entry["bytes"] == len(data) == stored[name], name
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert verify_checkpoint(path) == []


def test_an_object_changed_before_the_manifest_fails_the_save(s3) -> None:
    final, skip = objstore.begin("s3://ckpt/run", 5)
    assert not skip
    storage = objstore.writer(final)
    collective.quiet_single_process_notice()
    dcp.save({"model": _tree(2)}, storage_writer=storage, no_dist=True)
    shard = next(d.name for d in storage.written() if d.name.endswith(".distcp"))
    key = f"{final[len('s3://'):]}/{shard}"
    s3.pipe_file(key, s3.cat_file(key)[:-100])  # the store now holds a shorter object
    with pytest.raises(CheckpointError, match=f"{shard}: .* bytes stored, .* sent"):
        objstore.seal("s3://ckpt/run", final, 5, config_toml="x = 1\n", keep_last=0,
                      written=storage.written())
    assert not s3.exists(f"{final[len('s3://'):]}/manifest.json")  # never a checkpoint
    assert objstore.list_checkpoints("s3://ckpt/run") == []


def _save_two_ranks(rank: int, world_size: int) -> dict:
    """Each rank saves tensors only it holds, so each writes its own shard object."""
    tree = {"model": {f"rank{rank}.{k}": v for k, v in _tree(10 + rank).items()}}
    path = objstore.save("s3://ckpt/two", 7, tree, config_toml="x = 1\n", keep_last=0)
    return {"path": path, "manifest": objstore.read_text(path, "manifest.json")}


def test_two_ranks_each_hash_their_own_objects_into_one_manifest(s3) -> None:
    from densetrain.testing import run_distributed

    results = run_distributed(_save_two_ranks, 2, timeout=180)
    path = results[0]["path"]
    manifest = json.loads(results[0]["manifest"])
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert [name.split("_")[2] for name in shards] == ["0", "1"]  # one object from each rank
    for name, entry in manifest["files"].items():
        data = s3.cat_file(f"{path[len('s3://'):]}/{name}")
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert verify_checkpoint(path) == []
    loaded = {"model": {f"rank{r}.{k}": torch.zeros_like(v)
                        for r in (0, 1) for k, v in _tree(10 + r).items()}}
    load_checkpoint(path, loaded)
    for r in (0, 1):
        for k, v in _tree(10 + r).items():
            assert torch.equal(loaded["model"][f"rank{r}.{k}"], v)
