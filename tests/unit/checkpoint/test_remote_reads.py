"""A checkpoint on an object store is fetched once per load, not once per tensor read.

Against a real local S3 server (moto's standalone server, the ``s3`` fixture). DCP's writer
stores tensors largest first and its reader reads them in the model's order, each through
``torch.load`` on a slice (its zip directory at the end first); through s3fs's default
read-ahead cache that fetched blocks several times (2.9x the shard for a 247 MB checkpoint in
benchmarks/RESULTS.md). The block sizes are scaled down here (256 KiB instead of 16 MiB for the
reader, and for s3fs's default) so that a 6 MB shard spans as many blocks as a large one does.
The bytes fetched are counted where s3fs fetches a range (``S3File._fetch_range``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from densetrain.checkpoint import load_checkpoint, objstore, safe_pickle

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
