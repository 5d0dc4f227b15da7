"""A flipped byte, a truncated file or a deleted file in the newest checkpoint: the resume
reports the file, sets the checkpoint aside (renamed, kept) and continues from the previous
verified one, and the losses equal an undisturbed run's."""

from __future__ import annotations

from pathlib import Path

import faultkit
import pytest

from densetrain.checkpoint import CheckpointDamagedError, load_checkpoint
from densetrain.train import Callback, train


class _StopAfter(Callback):
    """Raises after step ``at`` (the step's checkpoint is saved by then)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, parts, progress, report) -> None:
        if report.step == self.at:
            raise KeyboardInterrupt(f"stopped after step {self.at}")


def _flip(checkpoint: Path) -> str:
    shard = faultkit.largest_shard(checkpoint)
    faultkit.flip_byte(shard)
    return shard.name


def _truncate(checkpoint: Path) -> str:
    shard = faultkit.largest_shard(checkpoint)
    faultkit.truncate_half(shard)
    return shard.name


def _delete_metadata(checkpoint: Path) -> str:
    (checkpoint / ".metadata").unlink()
    return ".metadata"


@pytest.mark.parametrize("damage", [_flip, _truncate, _delete_metadata],
                         ids=["flipped-byte", "truncated-shard", "deleted-metadata"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(
        damage, fault_cache, reference, tmp_path, capfd) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(faultkit.job(fault_cache, run_dir), callbacks=[_StopAfter(4)])
    newest = run_dir / "checkpoints" / "step-00000004"
    bad_file = damage(newest)
    capfd.readouterr()
    summary = train(faultkit.job(fault_cache, run_dir))
    err = capfd.readouterr().err
    assert f"checkpoint {newest} is damaged ({bad_file}:" in err
    assert summary["resumed_from"].endswith("step-00000002")
    aside = run_dir / "checkpoints" / "step-00000004.damaged"
    assert aside.is_dir() and (aside / "manifest.json").is_file()  # kept, not deleted
    events = [e for e in faultkit.history(run_dir) if e["event"] == "checkpoint_set_aside"]
    assert len(events) == 1 and events[0]["damage"][0].startswith(bad_file)
    assert faultkit.curve(run_dir) == reference  # steps 3..6 recomputed, bit for bit


def test_loading_a_flipped_checkpoint_directly_is_refused(fault_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    job = faultkit.job(fault_cache, run_dir, "--training.steps=3")
    train(job)
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    shard = faultkit.largest_shard(checkpoint)
    faultkit.flip_byte(shard)
    with pytest.raises(CheckpointDamagedError, match=rf"{shard.name}: SHA-256"):
        load_checkpoint(checkpoint, {})
