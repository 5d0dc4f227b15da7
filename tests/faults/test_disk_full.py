"""A full disk during a checkpoint write: named as "no space left on device", the previous
checkpoint still verifies, and resuming it (on a disk with room) gives the undisturbed losses.

The disk is a small real tmpfs where the test may mount one (root); elsewhere the write error
is injected at the file layer DCP writes through (every stream fails with ENOSPC past a quota);
the file-layer case runs everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import shutil

import faultkit
import pytest

from densetrain.checkpoint import CheckpointError, verify_checkpoint
from densetrain.train import train

ONE_CHECKPOINT_ROOM = 3 << 20  # one tiny-job checkpoint is ~1.7 MB; two do not fit


class _QuotaStream:
    """A file whose writes fail with ENOSPC once the shared quota is used up."""

    def __init__(self, stream, quota: list[int]) -> None:
        self._stream = stream
        self._quota = quota

    def write(self, data) -> int:
        self._quota[0] -= len(data)
        if self._quota[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _full_disk(directory, monkeypatch, layer: str):
    if layer == "tmpfs" and faultkit.mount_tmpfs(directory, ONE_CHECKPOINT_ROOM):
        try:
            yield "tmpfs"
        finally:
            faultkit.unmount(directory)
        return
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream
    quota = [ONE_CHECKPOINT_ROOM]

    @contextlib.contextmanager
    def limited(self, path, mode):
        with real(self, path, mode) as stream:
            yield _QuotaStream(stream, quota) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", limited)
    yield "injected"
    monkeypatch.undo()


@pytest.mark.parametrize("layer", ["tmpfs", "file-layer"])
def test_full_disk_is_named_and_the_previous_checkpoint_resumes(
        layer, fault_cache, reference, tmp_path, monkeypatch) -> None:
    run_dir, disk = tmp_path / "run", tmp_path / "disk"
    disk.mkdir()
    with _full_disk(disk, monkeypatch, layer):
        with pytest.raises(CheckpointError) as failed:
            train(faultkit.job(fault_cache, run_dir, f"--checkpoint.dir={disk}"))
        assert "no space left on device" in str(failed.value)
        assert "the previous checkpoint step-00000002 is untouched" in str(failed.value)
        assert sorted(p.name for p in disk.iterdir()) == ["step-00000002"]  # no .tmp left
        assert verify_checkpoint(disk / "step-00000002") == []
        shutil.copytree(disk, tmp_path / "bigger")
    summary = train(faultkit.job(fault_cache, run_dir, f"--checkpoint.dir={tmp_path / 'bigger'}"))
    assert summary["resumed_from"].endswith("step-00000002")
    assert faultkit.curve(run_dir) == reference
