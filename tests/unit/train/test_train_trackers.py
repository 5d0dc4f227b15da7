"""The optional loggers hold the same records as ``metrics.jsonl``: TensorBoard (read back with
TensorBoard's own event reader), Weights & Biases in offline mode (read back from the run's
transaction log), and without tensorboard installed the run says so once and goes on."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from densetrain.train import read_metrics, train
from densetrain.train.loggers import TENSORBOARD_MISSING

COMMON = ("--training.steps=4", "--eval.interval=2", "--eval.sample_tokens=0",
          "--checkpoint.enabled=false", "--logging.plot=false")


def test_tensorboard_events_hold_the_metrics_records(make_job) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = make_job(*COMMON, "--logging.tensorboard=true")
    train(job)
    records = read_metrics(job.logging.run_dir)
    events = EventAccumulator(str(Path(job.logging.run_dir) / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(r["step"], r[key]) for r in records if key in r]
        assert [s for s, _ in logged] == [s for s, _ in expected]
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_missing_tensorboard_is_said_once_and_the_run_goes_on(make_job, monkeypatch,
                                                              capfd) -> None:
    # As if the package were not installed: importing it raises ImportError.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    job = make_job(*COMMON, "--logging.tensorboard=true")
    summary = train(job)
    err = capfd.readouterr().err
    assert err.count(TENSORBOARD_MISSING) == 1
    assert "pip install 'densetrain[tensorboard]'" in TENSORBOARD_MISSING
    assert not (Path(job.logging.run_dir) / "tensorboard").exists()
    assert [r["step"] for r in read_metrics(job.logging.run_dir)] == [1, 2, 3, 4]
    assert summary["steps"] == 4


def _wandb_records(path: Path):
    """The records of a W&B transaction log (``run-<id>.wandb``).

    Read here because wandb ships no Python reader of it: a 7-byte header (":W&B", magic,
    version), then the LevelDB log format (32 KiB blocks; each chunk a 7-byte header of CRC32,
    little-endian length and type FULL=1/FIRST=2/MIDDLE=3/LAST=4), each record a protobuf
    ``wandb.proto.wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = header, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending + chunk)
            pending = b""
        elif kind in (2, 3):
            pending += chunk
        else:  # zero padding at the end of a block
            pos += left - header - length


def _key(item) -> str:
    """A history or config item's key (long ones are stored split as ``nested_key``)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_the_records_and_the_config(make_job, tmp_path) -> None:
    pytest.importorskip("wandb")
    from densetrain.config import job_config_to_toml
    from densetrain.config.loader import tomllib

    job = make_job(*COMMON, "--logging.tensorboard=false", "--logging.wandb=true",
                   "--logging.wandb_mode=offline", f"--logging.wandb_dir={tmp_path / 'wb'}",
                   "--logging.wandb_project=tests")
    train(job)
    records = read_metrics(job.logging.run_dir)
    logs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    run_id = (Path(job.logging.run_dir) / "wandb_run_id").read_text().strip()
    assert logs[0].name == f"run-{run_id}.wandb"
    history, run_config = [], None
    for record in _wandb_records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(item): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            run_config = {_key(item): json.loads(item.value_json)
                          for item in record.run.config.update if not _key(item).startswith("_")}
            assert record.run.project == "tests"
            assert record.run.display_name == Path(job.logging.run_dir).name
    assert [h.get("step") for h in history] == [r["step"] for r in records] == [1, 2, 3, 4]
    for logged, record in zip(history, records, strict=True):
        for key, value in record.items():
            assert logged[key] == pytest.approx(value, rel=1e-12), key
    assert run_config == tomllib.loads(job_config_to_toml(job))


def test_wandb_requested_but_not_installed_fails_before_any_work(make_job, tmp_path,
                                                                 monkeypatch, capsys) -> None:
    from densetrain.cli.main import main
    from densetrain.testing import TINY_OVERRIDES

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cache = make_job().data.cache_dir
    code = main(["train", *TINY_OVERRIDES, f"--data.cache_dir={cache}",
                 f"--logging.run_dir={tmp_path / 'nowandb'}", "--logging.wandb=true"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "logging.wandb=true" in lines[0], err
    assert "pip install 'densetrain[wandb]'" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "nowandb").exists()
