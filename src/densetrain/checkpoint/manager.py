"""Atomic, retained checkpoints of a Stateful tree through `torch.distributed.checkpoint` (DCP).

Layout of a checkpoint directory::

    <dir>/step-00000100/        a complete checkpoint (DCP shards + .metadata)
        config.toml             the resolved job config
        COMPLETE                completion marker, written last
    <dir>/step-00000200.tmp/    a save in progress (or one that failed); never loaded

A save writes into ``step-N.tmp/`` on every rank, then rank 0 adds ``config.toml``, renames the
directory to ``step-N/`` and writes ``COMPLETE``. `latest_checkpoint` only returns directories
whose name parses and whose marker exists, so an interrupted save (exception, full disk, killed
process) can never be picked, and the previous checkpoint is never touched before the new one is
complete. The same code runs on one process (no process group) and on many.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from densetrain.checkpoint.state import RNGState

COMPLETE_MARKER = "COMPLETE"
CONFIG_FILE = "config.toml"
_NAME_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointShapeError(ValueError):
    """The checkpoint holds a tensor whose shape differs from the model's (another model)."""


class NonFiniteStateError(CheckpointError):
    """A model tensor holds NaN or inf; such a state is never saved."""


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a finished checkpoint (completion marker present)."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``directory`` as ``(step, path)``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME_RE.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _local_tensor(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _flatten(tree: Mapping[str, Any] | list, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts (and lists holding dicts or tensors) with dotted keys, as DCP does."""
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    flat: dict[str, Any] = {}
    for key, value in items:
        name = f"{prefix}{key}"
        nested = isinstance(value, Mapping) or (
            isinstance(value, list)
            and any(isinstance(v, (Mapping, torch.Tensor)) for v in value)
        )
        if nested:
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _first_non_finite(model_state: Mapping[str, Any]) -> str | None:
    for name, value in _flatten(model_state).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(_local_tensor(value)).all()):
                return name
    return None


def _agree_on(value: Any) -> list[Any]:
    """Every rank's ``value`` (a list of one on a single process)."""
    if not _dist_on():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _materialise(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


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

    Collective: every rank must call it. ``config_toml`` is stored beside the shards.
    ``keep_last`` > 0 deletes all but the newest ``keep_last`` complete checkpoints once the new
    one is complete. Before anything is written, the entry ``check_finite_key`` (the model) is
    checked for NaN/inf on every rank and `NonFiniteStateError` names the first bad tensor.
    On any failure the partial ``.tmp`` directory is removed and earlier checkpoints are intact.
    """
    root = Path(directory)
    final = root / checkpoint_name(step)
    if is_complete(final):
        _barrier()
        return final
    tree = _materialise(state)
    if check_finite_key is not None and check_finite_key in tree:
        bad = [b for b in _agree_on(_first_non_finite(tree[check_finite_key])) if b]
        if bad:
            raise NonFiniteStateError(
                f"refusing to save step {step}: tensor {check_finite_key}.{bad[0]} holds NaN or "
                "inf values"
            )
    tmp = root / (final.name + ".tmp")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # an unfinished directory of the same step
        tmp.mkdir()
    _barrier()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.save(tree, checkpoint_id=tmp, no_dist=not _dist_on())
    except BaseException as err:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint step {step} into {tmp} failed ({type(err).__name__}: {err}); "
            "the previous checkpoints are untouched"
        ) from err
    failure = None
    if _rank() == 0:
        failure = _finalise(tmp, final, config_toml, keep_last)
    failures = [f for f in _agree_on(failure) if f]
    if failures:
        raise CheckpointError(
            f"finalising checkpoint step {step} failed: {failures[0]}; "
            "the previous checkpoints are untouched"
        )
    return final


def _finalise(tmp: Path, final: Path, config_toml: str | None, keep_last: int) -> str | None:
    """Rank 0: add the config, make the checkpoint visible, then prune. Returns an error text."""
    try:
        if config_toml is not None:
            _write_atomic(tmp / CONFIG_FILE, config_toml)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _write_atomic(final / COMPLETE_MARKER, "")
        _fsync_dir(final.parent)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_complete(final):
            shutil.rmtree(final, ignore_errors=True)
        return f"{type(err).__name__}: {err}"
    if keep_last > 0:
        prune_checkpoints(final.parent, keep_last)
    return None


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted paths."""
    if keep_last <= 0:
        raise ValueError(f"checkpoint.keep_last must be >= 1 to prune, got {keep_last}")
    doomed = [path for _, path in list_checkpoints(directory)[:-keep_last]]
    for path in doomed:
        # Remove the marker first so a half-deleted directory is never taken as complete.
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_checkpoint_config(path: str | os.PathLike) -> str:
    """The resolved job config TOML stored in checkpoint ``path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}")
    return config_path.read_text(encoding="utf-8")


def checkpoint_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shapes of every tensor stored in checkpoint ``path`` (from DCP metadata)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def _check_against_metadata(tree: Mapping[str, Any], path: Path) -> None:
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, value in _flatten(tree).items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = metadata.get(name)
        if meta is None:
            raise CheckpointShapeError(
                f"checkpoint {path} has no tensor {name!r}; it was saved from a different model "
                "or job"
            )
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointShapeError(f"checkpoint {path}: {name!r} is not a tensor there")
        if tuple(meta.size) != tuple(value.shape):
            raise CheckpointShapeError(
                f"checkpoint {path}: tensor {name!r} has shape {tuple(meta.size)} but the "
                f"current model expects {tuple(value.shape)}; the checkpoint is from a "
                "different model shape"
            )


def load_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Load checkpoint ``path`` into the Stateful tree ``state`` in place (collective).

    Every tensor's shape is checked against the checkpoint metadata first; a mismatch raises
    `CheckpointShapeError` naming the tensor before any value is changed.
    """
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, value in state.items():
        if isinstance(value, RNGState):
            prefix = f"{key}.rank"
            value.available_ranks = {
                int(k[len(prefix) :]) for k in stored if k.startswith(prefix)
            }
    tree = _materialise(state)
    _check_against_metadata(tree, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(tree, checkpoint_id=path, no_dist=not _dist_on())
    for key, value in state.items():
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(tree[key])
