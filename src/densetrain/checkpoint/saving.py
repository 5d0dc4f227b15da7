"""Writing a checkpoint: a ``.tmp`` directory, the DCP shards, then the seal (config, manifest,
rename). `save_checkpoint` does all three at once; the async checkpointer (async_save.py) runs
the same `begin_save` / `seal_checkpoint` around `dcp.async_save`.

A failure at any point leaves only a ``.tmp`` directory (removed) and never touches an earlier
checkpoint. A write that fails because the filesystem is full is named as such, whatever layer
reports it (DCP's serializer turns a short write into ``unexpected pos ...``).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from densetrain.checkpoint import collective
from densetrain.checkpoint.manager import (
    CONFIG_FILE,
    CheckpointError,
    NonFiniteStateError,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    materialise,
    prune_checkpoints,
    set_aside,
)
from densetrain.checkpoint.manifest import (
    checkpoint_files,
    digest_files,
    manifest_text,
    sha256_text,
    share_of,
    write_manifest_file,
)
from densetrain.errors import RankFailure

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL_BYTES = 1 << 20


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _free_bytes(directory: Path) -> int | None:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _errors_in(err: BaseException) -> list[BaseException]:
    """``err``, its causes, and the per-rank failures a DCP ``CheckpointException`` carries."""
    found: list[BaseException] = []
    pending: list[BaseException] = [err]
    while pending:
        seen = pending.pop()
        if seen in found:
            continue
        found.append(seen)
        pending += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        for failure in (getattr(seen, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                pending.append(inner)
    return found


def _disk_is_full(err: BaseException, directory: Path) -> bool:
    if any(isinstance(e, OSError) and e.errno in _FULL_ERRNOS for e in _errors_in(err)):
        return True
    free = _free_bytes(directory)
    return free is not None and free < _NEARLY_FULL_BYTES


def _write_cut_short(err: BaseException) -> bool:
    # torch's zip serializer reports a refused write as "unexpected pos N vs M" and drops the
    # OSError that caused it.
    return any("unexpected pos" in str(e) for e in _errors_in(err))


def lost_peer(err: BaseException) -> BaseException | None:
    """The failed collective behind a failed save, if a peer rank was lost (gloo's "connection
    reset", a timeout): ``err`` itself, its cause or context, or a rank's failure inside DCP's
    ``CheckpointException``; None for any other failure (a full disk, a bug)."""
    from densetrain.parallel.distributed import is_collective_failure

    seen: set[int] = set()
    todo = [err]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, RankFailure) or is_collective_failure(item):
            return item
        todo += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)  # DCP: {rank: (exception, traceback)}
        if isinstance(failures, Mapping):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    return None


def save_failure(err: BaseException, root: str | os.PathLike, step: int,
                 describe: Any = None) -> BaseException:
    """The exception to raise for a failed save: a lost peer's `CollectiveError` (naming the
    rank that died or stopped, as `collective_step` does for a step; the backend's text goes to
    the log), so that the run ends as a rank failure whatever ``on_save_error`` says; else a
    `CheckpointError` with ``describe(err)`` (default `describe_write_error`)."""
    from densetrain.parallel.distributed import collective_error

    cause = lost_peer(err)
    if isinstance(cause, RankFailure):
        return cause
    if cause is not None:
        return collective_error(cause)
    if describe is None:
        return CheckpointError(describe_write_error(err, Path(root), step))
    return CheckpointError(describe(err))


def describe_write_error(err: BaseException, root: Path, step: int) -> str:
    """One sentence for a failed checkpoint write; a full disk is named as such."""
    previous = latest_checkpoint(root)
    kept = f"the previous checkpoint {previous.name} is untouched" if previous else (
        "no earlier checkpoint exists")
    if _disk_is_full(err, root):
        return (f"saving checkpoint step {step} into {root} failed: no space left on device "
                f"({_free_bytes(root) or 0} bytes free); {kept}. Free space on that disk or "
                "set checkpoint.dir to a larger one")
    if _write_cut_short(err):
        return (f"saving checkpoint step {step} into {root} failed: the filesystem cut a write "
                "short, as a full disk (no space left on device) or an exhausted quota does "
                f"({_free_bytes(root)} bytes free now); {kept}")
    return f"saving checkpoint step {step} into {root} failed ({type(err).__name__}: {err}); {kept}"


def _floating_tensors(tree: Mapping[str, Any] | list, prefix: str = ""):
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (Mapping, list, tuple)):
            yield from _floating_tensors(dict(enumerate(value)) if isinstance(value, tuple)
                                         else value, name + ".")
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            yield name, value.to_local() if hasattr(value, "to_local") else value


def first_non_finite(tree: Mapping[str, Any]) -> str | None:
    """Dotted name of the first floating tensor of ``tree`` (this rank's part of it) holding
    NaN or inf, else None. One host sync for the whole tree: the per-tensor flags are reduced
    on the device first."""
    named = list(_floating_tensors(tree))
    if not named:
        return None
    flags = torch.stack([torch.isfinite(t).all().to(named[0][1].device) for _, t in named])
    if bool(flags.all()):  # the one host sync
        return None
    return named[int((~flags).nonzero()[0, 0])][0]


def check_state_finite(state: Mapping[str, Any], step: int) -> dict[str, Any]:
    """Materialise the Stateful tree ``state`` and raise `NonFiniteStateError` naming the first
    tensor (on any rank) holding NaN/inf; returns the materialised tree. Collective."""
    tree = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    bad = first_non_finite(tree)
    found = collective.gather_all(bad)
    for bad_rank, name in enumerate(found):
        if name:
            raise NonFiniteStateError(
                f"refusing to save step {step}: tensor {name} on rank {bad_rank} holds NaN or inf "
                "values (the whole state is checked: model, optimizer, schedules, data)"
            )
    return tree


def check_finite(tree: Mapping[str, Any], key: str | None, step: int) -> None:
    """Raise `NonFiniteStateError` (on every rank) naming the first NaN/inf tensor of
    ``tree[key]`` on any rank (collective; one host sync, `first_non_finite`)."""
    if key is None or key not in tree:
        return
    local = first_non_finite({key: tree[key]})
    bad = collective.first_error(local)
    if bad:
        raise NonFiniteStateError(
            f"refusing to save step {step}: tensor {bad} holds NaN or inf values"
        )


def begin_save(root: Path, step: int, group: Any = None) -> Path | None:
    """Create an empty ``step-N.tmp`` under ``root`` (rank 0) and return it on every rank; None
    when ``step-N`` is already a complete checkpoint (collective over ``group``)."""
    final = root / checkpoint_name(step)
    if is_complete(final):
        collective.barrier(group)
        return None
    tmp = root / (final.name + ".tmp")
    failure = None
    if collective.rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a killed save; never a checkpoint
            if final.exists():  # a step-N without a manifest: damaged, kept for inspection
                set_aside(final, "incomplete")
            tmp.mkdir()
        except OSError as err:
            failure = describe_write_error(err, root, step)
    failure = collective.first_error(failure, group)
    if failure:
        raise CheckpointError(failure)
    return tmp


def write_shards(tree: Mapping[str, Any], tmp: Path, step: int) -> None:
    """``dcp.save`` of ``tree`` into ``tmp`` (collective); a failure removes ``tmp``."""
    try:
        collective.quiet_single_process_notice()
        dcp.save(tree, checkpoint_id=tmp, no_dist=not collective.dist_on())
    except BaseException as err:
        failure = save_failure(err, tmp.parent, step)  # before the space is freed
        if collective.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure from err


def seal_checkpoint(tmp: Path, *, step: int, config_toml: str | None, keep_last: int,
                    group: Any = None) -> Path:
    """Add the config and the manifest to the written ``tmp`` directory and rename it to
    ``step-N`` (collective over ``group``; the ranks share the hashing). Returns the path."""
    final = tmp.parent / checkpoint_name(step)
    failure = None
    if collective.rank() == 0 and config_toml is not None:
        failure = _try(lambda: _write_durably(tmp / CONFIG_FILE, config_toml), tmp, step)
    failure = collective.first_error(failure, group)
    if not failure:
        mine = share_of(checkpoint_files(tmp), collective.rank(), collective.world_size())
        local: list[Any] | str
        try:
            local = digest_files(tmp, mine)
        except OSError as err:
            local = describe_write_error(err, tmp.parent, step)
        gathered = collective.gather_all(local, group)
        failure = next((g for g in gathered if isinstance(g, str)), None)
        if failure is None and collective.rank() == 0:
            digests = [d for part in gathered for d in part]
            text = manifest_text(digests, step=step, config_sha256=sha256_text(config_toml or ""))
            failure = _try(lambda: _publish(tmp, final, text), tmp, step)
            if failure is None and keep_last > 0:
                prune_checkpoints(final.parent, keep_last)
        failure = collective.first_error(failure, group)
    if failure:
        if collective.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(failure)
    return final


def _try(action: Any, tmp: Path, step: int) -> str | None:
    try:
        action()
    except OSError as err:
        return describe_write_error(err, tmp.parent, step)
    return None


def _publish(tmp: Path, final: Path, manifest: str) -> None:
    write_manifest_file(tmp, manifest)
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: Mapping[str, Any],
    *,
    config_toml: str | None = None,
    keep_last: int = 0,
    check_finite_key: str | None = "model",
) -> Path:
    """Save the Stateful tree ``state`` as ``<directory>/step-<step>/`` and return its path.

    Collective: every rank must call it. ``config_toml`` is stored beside the shards and its
    SHA-256 in the manifest. ``keep_last`` > 0 deletes all but the newest ``keep_last`` complete
    checkpoints once the new one is complete. Before anything is written, the entry
    ``check_finite_key`` (the model) is checked for NaN/inf on every rank and
    `NonFiniteStateError` names the first bad tensor. On any failure the partial ``.tmp``
    directory is removed and earlier checkpoints are intact.
    """
    root = Path(directory)
    tree = materialise(state)
    check_finite(tree, check_finite_key, step)
    tmp = begin_save(root, step)
    if tmp is None:
        return root / checkpoint_name(step)
    write_shards(tree, tmp, step)
    return seal_checkpoint(tmp, step=step, config_toml=config_toml, keep_last=keep_last)
