"""``prepare`` over many workers: local processes (``--workers N``) or torchrun ranks.

The phases are in `densetrain.data.scaleout_tasks`; this module partitions the inputs, runs the
phases (as local processes, or as the ranks of a torchrun job, e.g. ``srun torchrun`` on SLURM)
and merges the results into the same ``progress.json``, ``meta.json`` and shard files the
single-process path writes, byte for byte, whatever the number of workers. Work in progress
lives in ``OUTPUT/.scaleout``; a rerun of the same command after a worker died (or an I/O
error) resumes from the tasks that completed, and the directory is removed once ``meta.json`` is
written. A failure on the input itself (a malformed line, nothing left after filtering) removes
the work instead: a rerun would fail the same way.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from densetrain.data.prepare import (
    PROGRESS_FILE,
    WORK_DIR,
    OutputClaim,
    PrepareConfig,
    _check_not_empty,
    _copy_tokenizer,
    _Preparer,
    claim_output_dir,
)
from densetrain.data.scaleout_tasks import run_decide, run_scan, run_write, scan_path
from densetrain.data.shards import META_FILE, atomic_write_json, dtype_for_vocab
from densetrain.data.sources import ReadStats, expand_inputs
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.errors import UserError, UserFileExistsError


class ResumableFailure(UserError):
    """A worker died or met an I/O error: the completed tasks are kept and a rerun resumes."""


def partition_files(files: list[Path], workers: int) -> list[list[Path]]:
    """Contiguous runs of ``files`` (in input order) of about equal bytes, one per worker.

    A file is the unit of work: a worker gets whole files, so a corpus of fewer files than
    workers leaves some workers idle.
    """
    sizes = [max(os.path.getsize(p), 1) for p in files]
    total, parts, start = sum(sizes), [[] for _ in range(workers)], 0
    for path, size in zip(files, sizes, strict=True):
        rank = min(start * workers // max(total, 1), workers - 1)
        parts[rank].append(path)
        start += size
    return parts


def _describe(part: list[Path]) -> str:
    if not part:
        return "no input files"
    return f"{len(part)} input files {part[0]} .. {part[-1]}" if len(part) > 1 else str(part[0])


def start_work(inputs: list[str], out: Path, tok: Tokenizer, cfg: PrepareConfig, workers: int,
               overwrite: bool) -> tuple[OutputClaim, list[list[Path]]]:
    """Check the inputs and the output directory, write or check the manifest; where the run
    builds and the files of each worker."""
    cfg.validate()
    files = expand_inputs(list(inputs))  # the inputs are checked before the output is touched
    claim = claim_output_dir(out, overwrite)
    out, work = claim.build, claim.build / WORK_DIR
    if claim.staged and not (work / "manifest.json").is_file() and out.exists():
        claim.reset()  # an unfinished --overwrite of another kind: start it again
    if (out / PROGRESS_FILE).exists() and not work.is_dir():
        raise UserFileExistsError(f"{out} holds an interrupted single-process prepare; rerun it "
                                  "without --workers, or start again with --overwrite")
    manifest = {
        "settings_hash": cfg.settings_hash(),
        "tokenizer_fingerprint": tok.fingerprint,
        "workers": workers,
        "inputs": [[str(p), os.path.getsize(p)] for p in files],
    }
    path = work / "manifest.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        for key, value in manifest.items():
            if saved.get(key) != value and claim.staged:  # an --overwrite that changed: anew
                claim.reset()
                return start_work(inputs, claim.target, tok, cfg, workers, overwrite)
            if saved.get(key) != value:
                raise UserError(
                    f"{out} holds an interrupted prepare with a different {key} (it had "
                    f"{saved.get(key) if key == 'workers' else 'other ' + key}); rerun with the "
                    "same inputs, settings and --workers, or start again with --overwrite"
                )
        for stale in out.rglob("*.tmp"):  # the half-written files of a killed worker
            stale.unlink()
    else:
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, manifest)
    return claim, partition_files(files, workers)


def merge_work(inputs: list[str], out: Path, tok: Tokenizer, cfg: PrepareConfig,
               parts: list[list[Path]]) -> dict:
    """Write ``progress.json`` and ``meta.json`` from the completed tasks; remove the work."""
    work, workers = out / WORK_DIR, len(parts)
    scans = [json.loads(scan_path(work, r, "json").read_text()) for r in range(workers)]
    plan = json.loads((work / "decide" / "plan.json").read_text())
    written: dict[str, dict] = {}
    for rank in range(workers):
        written.update(json.loads((work / "write" / f"{rank:05d}.json").read_text()))
    files = [p for part in parts for p in part]
    preparer = _Preparer(files, out, tok, cfg, [s for scan in scans for s in scan["sources"]])
    preparer.read_stats = _merge_read_stats([scan["read"] for scan in scans])
    shards = {"train": [], "val": []}
    dedup_files = []
    for index, commit in enumerate(plan["commits"]):
        shards["train"] += [written[f"train/{index}"]] if commit["train"] else []
        shards["val"] += [written[f"val/{index}"]] if commit["val"] else []
        if cfg.exact_dedup or cfg.near_dedup:
            dedup_files.append(f"dedup/{index:05d}.npz")
    preparer.state.update(
        consumed_documents=plan["documents"], commits=len(plan["commits"]), shards=shards,
        kept_documents=plan["kept_documents"], removed=plan["removed"], dedup_files=dedup_files,
    )
    meta = preparer.metadata()
    _check_not_empty(list(inputs), preparer.read_stats, meta)
    for name in dedup_files:
        (out / "dedup").mkdir(exist_ok=True)
        source = work / "decide" / Path(name).name
        if source.is_file() or not (out / name).is_file():  # else moved by an interrupted merge
            os.replace(source, out / name)
    atomic_write_json(out / PROGRESS_FILE, preparer.state)
    _copy_tokenizer(tok, out / meta["tokenizer"]["file"])
    atomic_write_json(out / META_FILE, meta)
    shutil.rmtree(work)
    return meta


def _merge_read_stats(parts: list[dict]) -> ReadStats:
    """Sums of the workers' counts; the first ten examples in input order (as one reader)."""
    stats = ReadStats()
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                getattr(stats, key).extend(value[: 10 - len(getattr(stats, key))])
            else:
                setattr(stats, key, getattr(stats, key) + value)
    return stats


def _task_entry(fn: Callable, phase: str, rank: int, work: str, threads: int, args: tuple) -> None:
    """A worker process: run one task; on an exception leave its message for the parent."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # the tokenizer's threads, before first use
    pid_file = Path(work) / "running" / f"{phase}-{rank:05d}.pid"
    pid_file.write_text(f"{os.getpid()}\n")
    try:
        fn(*args)
    except BaseException as error:  # noqa: BLE001 - reported by the parent, naming the worker
        from densetrain.errors import is_user_error

        message = str(error) if is_user_error(error) else (
            f"internal error {type(error).__name__}: {error}")
        atomic_write_json(Path(work) / "errors" / f"{phase}-{rank:05d}.json",
                          {"message": message, "input_error": isinstance(error, UserError)})
        sys.exit(1)
    pid_file.unlink()


def _failure(phase: str, rank: int, who: str, exitcode: int, work: Path) -> tuple[str, bool]:
    """What a worker's failure was, and whether it was an error in the input (a UserError)."""
    error_file = work / "errors" / f"{phase}-{rank:05d}.json"
    input_error = False
    if error_file.is_file():
        saved = json.loads(error_file.read_text())
        what, input_error = saved["message"], saved.get("input_error", False)
        error_file.unlink()
    elif exitcode < 0:
        what = f"killed by signal {signal.Signals(-exitcode).name}"
    else:
        what = f"exited with status {exitcode}"
    return f"{who} failed: {what}", input_error


def _raise_failures(failures: list[tuple[str, bool]], work: Path | None) -> None:
    """`UserError` for an error in the input (a rerun meets it again: the caller removes the
    work); `ResumableFailure` when workers only died or met I/O errors (a rerun resumes)."""
    text = "; ".join(message for message, _ in failures)
    if any(input_error for _, input_error in failures):
        raise UserError(f"{text}. No {META_FILE} was written and the work in progress was "
                        "removed (a rerun would meet the same error)")
    raise ResumableFailure(f"{text}. The completed work is kept in {work} and no {META_FILE} "
                           "was written: rerun the same command to resume")


def run_local_phase(phase: str, tasks: list[tuple[Callable, tuple]], work: Path,
                    parts: list[list[Path]]) -> None:
    """Run one phase's tasks as local processes; raise naming every worker that failed."""
    workers = len(parts)
    threads = max(1, (os.cpu_count() or 1) // len(tasks))
    for sub in ("running", "errors"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_task_entry, name=f"densetrain-prepare-{phase}-{rank}",
                        args=(fn, phase, rank, str(work), threads, args))
        for rank, (fn, args) in enumerate(tasks)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()

    def who(rank: int) -> str:
        if len(tasks) == 1:
            return f"the prepare {phase} task (one process over all inputs)"
        return f"prepare worker {rank} of {workers} ({phase} phase, {_describe(parts[rank])})"

    failures = [_failure(phase, rank, who(rank), p.exitcode, work)
                for rank, p in enumerate(processes) if p.exitcode != 0]
    if failures:
        _raise_failures(failures, work)


def resolve_workers(workers: int) -> int:
    """``workers``, or every core for 0."""
    if workers < 0:
        raise UserError(f"--workers must be >= 0 (0: one per core), got {workers}")
    return workers or (os.cpu_count() or 1)


def prepare_dataset_parallel(
    inputs: list[str],
    output_dir: str | os.PathLike,
    *,
    tokenizer: Tokenizer | str | os.PathLike,
    cfg: PrepareConfig | None = None,
    workers: int = 0,
    overwrite: bool = False,
) -> dict:
    """`prepare_dataset` on ``workers`` local processes (0: one per core); same output.

    Raises `ResumableFailure` naming the worker that died (the completed tasks are kept, so
    rerunning the same call resumes), or `UserError` for an error in the input (the work in
    progress is removed: a rerun would meet it again).
    """
    from densetrain.data.remote import local_dataset_path, prepare_to_url

    if local_dataset_path(str(output_dir)) is None:  # a URL: prepared here, then uploaded
        return prepare_to_url(prepare_dataset_parallel, inputs, str(output_dir),
                              tokenizer=tokenizer, cfg=cfg, workers=workers, overwrite=overwrite)
    output_dir = local_dataset_path(str(output_dir))
    cfg = cfg or PrepareConfig()
    workers = resolve_workers(workers)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    claim, parts = start_work(inputs, Path(output_dir), tok, cfg, workers, overwrite)
    out = claim.build
    work, dtype = out / WORK_DIR, dtype_for_vocab(tok.vocab_size)
    tok_path = tok.path
    try:
        run_local_phase("scan", [(_scan_task, (str(work), r, part, tok_path, cfg))
                                 for r, part in enumerate(parts)], work, parts)
        run_local_phase("decide", [(run_decide, (work, workers, cfg))], work, parts)
        run_local_phase("write", [(run_write, (work, out, r, workers, dtype))
                                  for r in range(workers)], work, parts)
        meta = merge_work(inputs, out, tok, cfg, parts)
    except ResumableFailure:
        raise
    except ValueError:  # an error in the input
        claim.discard()
        raise
    claim.finish()
    return meta


def _agree(phase: str, rank: int, world: int, task: Callable[[], object],
           work: Path | None = None) -> object:
    """Run ``task`` on this rank, then raise on every rank if any rank's task failed."""
    import torch.distributed as dist

    value, error = None, None
    try:
        value = task()
    except Exception as failure:  # noqa: BLE001 - every rank raises it, naming the rank
        message = str(failure) if isinstance(failure, (ValueError, OSError)) else (
            f"internal error {type(failure).__name__}: {failure}")
        error = (message, isinstance(failure, ValueError))
    errors: list[tuple[str, bool] | None] = [None] * world
    dist.all_gather_object(errors, error)
    failed = [(f"prepare rank {r} of {world} ({phase} phase) failed: {e[0]}", e[1])
              for r, e in enumerate(errors) if e is not None]
    if failed and phase == "start":  # nothing was run yet: the message says what to change
        raise UserError("; ".join(message for message, _ in failed))
    if failed:
        _raise_failures(failed, work)
    return value


def prepare_dataset_distributed(
    inputs: list[str],
    output_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike,
    cfg: PrepareConfig | None = None,
    overwrite: bool = False,
    timeout_hours: float = 24.0,
) -> dict | None:
    """One rank of `prepare_dataset_parallel` under torchrun (one worker per rank).

    ``output_dir`` must be on a file system every rank sees. Uses the initialised process group,
    or starts a gloo one from torchrun's environment (with ``timeout_hours`` for the serial
    decide phase). Returns the metadata on rank 0 and None on the others. A rank that dies is
    reported by torchrun, naming it; rerunning resumes from the completed tasks. An error in the
    input, on any rank, removes the work in progress (rank 0 does), as in
    `prepare_dataset_parallel`.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from densetrain.data.remote import is_url

    if is_url(str(output_dir)):
        raise UserError(f"--output {output_dir}: --distributed writes to a file system every rank "
                        "sees, not a URL; prepare with --workers N and --output URL, or upload "
                        "the prepared directory")
    cfg = cfg or PrepareConfig()
    from densetrain.parallel.distributed import env_local_world_size

    local = env_local_world_size()
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local)))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", timeout=timedelta(hours=timeout_hours))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        tok = load_tokenizer(tokenizer)
        started = _agree("start", rank, world, lambda: rank == 0 and start_work(
            inputs, Path(output_dir), tok, cfg, world, overwrite))
        claim = started[0] if rank == 0 else None
        where = [claim.build if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)  # an --overwrite builds beside the old dataset
        out = Path(where[0])
        work, dtype = out / WORK_DIR, dtype_for_vocab(tok.vocab_size)
        parts = partition_files(expand_inputs(list(inputs)), world)
        try:
            _agree("scan", rank, world, lambda: run_scan(work, rank, parts[rank], tok, cfg), work)
            _agree("decide", rank, world, lambda: rank == 0 and run_decide(work, world, cfg),
                   work)
            _agree("write", rank, world, lambda: run_write(work, out, rank, world, dtype), work)
            meta = _agree("merge", rank, world, lambda: (
                _merge_and_finish(inputs, claim, tok, cfg, parts) if rank == 0 else None), work)
        except ResumableFailure:
            raise
        except ValueError:  # an error in the input, on some rank: every rank raises it
            if claim is not None:
                claim.discard()
            raise
        return meta if rank == 0 else None
    finally:
        if owns_group:
            dist.destroy_process_group()


def _merge_and_finish(inputs: list[str], claim: OutputClaim, tok: Tokenizer, cfg: PrepareConfig,
                      parts: list[list[Path]]) -> dict:
    meta = merge_work(inputs, claim.build, tok, cfg, parts)
    claim.finish()
    return meta


def _scan_task(work: str, rank: int, files: list[Path], tokenizer_path: str,
               cfg: PrepareConfig) -> None:
    run_scan(Path(work), rank, files, load_tokenizer(tokenizer_path), cfg)
