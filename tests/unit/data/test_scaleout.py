"""``prepare`` on many workers writes what the single-process path writes, byte for byte.

The reference is the single-process `prepare_dataset` on the same inputs and settings (filters,
exact and MinHash dedup and a validation split on). Workers are real processes: local spawned
processes (``--workers``) and gloo ranks (the torchrun path); the failure test really kills one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import synthetic_documents, write_text_files

from densetrain.cli.main import main
from densetrain.data import PrepareConfig, prepare_dataset
from densetrain.data.scaleout import (
    partition_files,
    prepare_dataset_distributed,
    prepare_dataset_parallel,
)
from densetrain.data.scaleout_tasks import WORK_DIR
from densetrain.data.shards import load_metadata
from densetrain.errors import UserError
from densetrain.testing import run_distributed


def _corpus_docs() -> list[str]:
    """Documents with exact duplicates, near duplicates, short (filtered) and empty ones."""
    docs = synthetic_documents(160, seed=3)
    near = [d.replace(" the ", " teh ", 1) for d in docs[20:35]]
    return docs + docs[:25] + near + ["short text only", "   \n"] * 4


def _cfg() -> PrepareConfig:
    cfg = PrepareConfig(val_fraction=0.1, shard_tokens=2500, batch_bytes=2000, exact_dedup=True,
                        near_dedup=True, quality_filter=True)
    cfg.quality.min_words = 25  # the synthetic documents are short; keep most of them
    return cfg


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("scaleout") / "raw"
    write_text_files(raw, _corpus_docs())
    return raw


@pytest.fixture(scope="module")
def reference(raw_dir, tokenizer_path) -> Path:
    out = raw_dir.parent / "single"
    prepare_dataset([str(raw_dir)], out, tokenizer=tokenizer_path, cfg=_cfg())
    return out


def _assert_same_dataset(expected: Path, found: Path) -> None:
    """Every file byte-identical; the dedup state's arrays equal (zip entries carry a time)."""
    names = sorted(p.relative_to(expected).as_posix() for p in expected.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(found).as_posix() for p in found.rglob("*")
                           if p.is_file())
    for name in names:
        if name.endswith(".npz"):
            with np.load(expected / name) as a, np.load(found / name) as b:
                for key in ("exact", "minhash"):
                    np.testing.assert_array_equal(a[key], b[key])
        else:
            assert (expected / name).read_bytes() == (found / name).read_bytes(), name


def test_reference_exercises_every_removal(reference) -> None:
    removed = load_metadata(reference)["counts"]["removed"]
    assert {"exact_duplicate", "near_duplicate", "empty", "quality:word_count"} <= set(removed)
    assert len(load_metadata(reference)["splits"]["train"]["shards"]) >= 4


@pytest.mark.parametrize("workers", [2, 3])
def test_local_workers_match_single_process(workers, raw_dir, tokenizer_path, reference,
                                            tmp_path) -> None:
    meta = prepare_dataset_parallel([str(raw_dir)], tmp_path / "out", tokenizer=tokenizer_path,
                                    cfg=_cfg(), workers=workers)
    assert json.loads(json.dumps(meta)) == load_metadata(reference)
    _assert_same_dataset(reference, tmp_path / "out")


def _distributed_rank(rank: int, world: int, raw: str, out: str, tokenizer: str) -> bool:
    meta = prepare_dataset_distributed([raw], out, tokenizer=tokenizer, cfg=_cfg())
    return meta is not None


def test_torchrun_ranks_match_single_process(raw_dir, tokenizer_path, reference, tmp_path):
    results = run_distributed(_distributed_rank, 2, str(raw_dir), str(tmp_path / "out"),
                              str(tokenizer_path))
    assert results == [True, False]  # rank 0 merges and returns the metadata
    _assert_same_dataset(reference, tmp_path / "out")


def test_partition_is_contiguous_and_covers_every_file(raw_dir) -> None:
    files = sorted(raw_dir.iterdir())
    parts = partition_files(files, 4)
    assert [p for part in parts for p in part] == files
    assert all(parts)


def _prepare_command(raw: Path, out: Path, tokenizer: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "densetrain.cli.main", "data", "prepare", str(raw), "-o",
            str(out), "--tokenizer", str(tokenizer), "--workers", "2", "--near-dedup",
            "--quality-filter", *extra]


def test_killed_worker_is_named_leaves_no_dataset_and_rerun_resumes(tmp_path, tokenizer_path):
    raw = tmp_path / "raw"
    write_text_files(raw, synthetic_documents(500, seed=5, min_words=300, max_words=600))
    out = tmp_path / "out"
    command = _prepare_command(raw, out, tokenizer_path)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = out / WORK_DIR / "running" / "scan-00001.pid"
    deadline = time.monotonic() + 120
    while not (pid_file.is_file() and pid_file.read_text().endswith("\n")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.005)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode != 0
    assert "prepare worker 1 of 2 (scan phase" in stderr and "SIGKILL" in stderr, stderr
    assert "Traceback" not in stderr
    assert not (out / "meta.json").exists()
    assert not (out / WORK_DIR / "scan" / "00001.json").exists()
    with pytest.raises(FileNotFoundError):
        load_metadata(out)
    with pytest.raises(FileExistsError, match="several workers"):
        prepare_dataset([str(raw)], out, tokenizer=tokenizer_path)
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    reference = tmp_path / "single"
    cfg = PrepareConfig(near_dedup=True, quality_filter=True)
    prepare_dataset([str(raw)], reference, tokenizer=tokenizer_path, cfg=cfg)
    _assert_same_dataset(reference, out)


def test_bad_jsonl_line_names_file_line_and_worker(tmp_path, tokenizer_path, capsys) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        lines = [json.dumps({"text": doc}) for doc in synthetic_documents(5, seed=i)]
        if i == 3:
            lines[2] = '{"text": broken'
        (raw / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["data", "prepare", str(raw), "-o", str(tmp_path / "out"), "--tokenizer",
                 str(tokenizer_path), "--workers", "2"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "prepare worker 1 of 2 (scan phase" in err and "part3.jsonl:3" in err, err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_resume_with_other_worker_count_is_refused(raw_dir, tokenizer_path, tmp_path) -> None:
    out = tmp_path / "out"
    (out / WORK_DIR).mkdir(parents=True)
    (out / WORK_DIR / "manifest.json").write_text(json.dumps({"workers": 5}))
    with pytest.raises(UserError, match="different settings_hash"):
        prepare_dataset_parallel([str(raw_dir)], out, tokenizer=tokenizer_path, cfg=_cfg(),
                                 workers=2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--workers", "-1"], "--workers must be >= 0"),
        (["--workers", "2", "--max-shards", "1"], "--max-shards applies"),
        (["--workers", "2", "--distributed"], "not both"),
    ],
)
def test_bad_worker_options_are_one_clear_error(extra, message, raw_dir, tokenizer_path,
                                                tmp_path, capsys) -> None:
    code = main(["data", "prepare", str(raw_dir), "-o", str(tmp_path / "out"), "--tokenizer",
                 str(tokenizer_path), *extra])
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err, err


def test_existing_dataset_and_foreign_directory_are_refused(reference, raw_dir, tokenizer_path,
                                                           tmp_path) -> None:
    with pytest.raises(FileExistsError, match="already a prepared dataset"):
        prepare_dataset_parallel([str(raw_dir)], reference, tokenizer=tokenizer_path,
                                 cfg=_cfg(), workers=2)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare_dataset_parallel([str(raw_dir)], tmp_path / "other", tokenizer=tokenizer_path,
                                 cfg=_cfg(), workers=2)


@pytest.mark.slow
def test_documented_torchrun_command_matches_single_process(raw_dir, tokenizer_path,
                                                            tmp_path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "densetrain.cli.main", "data", "prepare",
               str(raw_dir), "-o", str(out), "--tokenizer", str(tokenizer_path), "--distributed",
               "--val-fraction", "0.1", "--shard-tokens", "2500", "--exact-dedup",
               "--near-dedup", "--quality-filter"]
    cfg = _cfg()
    cfg.quality.min_words, cfg.batch_bytes = 50, 1 << 22  # the command line's defaults
    expected = tmp_path / "single"
    prepare_dataset([str(raw_dir)], expected, tokenizer=tokenizer_path, cfg=cfg)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    _assert_same_dataset(expected, out)


def test_missing_input_and_all_filtered_input_are_clear_errors(tmp_path, tokenizer_path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        prepare_dataset_parallel([str(tmp_path / "nowhere")], tmp_path / "a",
                                 tokenizer=tokenizer_path, workers=2)
    raw = tmp_path / "raw"
    write_text_files(raw, ["too short"] * 6)
    cfg = PrepareConfig(quality_filter=True)
    with pytest.raises(UserError, match="survived filtering") as single:
        prepare_dataset([str(raw)], tmp_path / "one", tokenizer=tokenizer_path, cfg=cfg)
    with pytest.raises(UserError, match="survived filtering") as parallel:
        prepare_dataset_parallel([str(raw)], tmp_path / "many", tokenizer=tokenizer_path,
                                 cfg=cfg, workers=2)
    assert str(parallel.value) == str(single.value)
    assert not (tmp_path / "many" / "meta.json").exists()
