"""Atomic, verified, retained checkpoints of a Stateful tree through `torch.distributed.checkpoint`.

Layout of a checkpoint directory::

    <dir>/step-00000100/           a complete checkpoint
        __0_0.distcp, .metadata    DCP shards and metadata
        config.toml                the resolved job config
        manifest.json              size + SHA-256 of every file above (manifest.py), written last
    <dir>/step-00000200.tmp/       a save in progress (or one that failed); never loaded
    <dir>/step-00000050.damaged/   a checkpoint whose manifest did not verify, set aside on resume

A save (saving.py) writes into ``step-N.tmp/`` on every rank, then rank 0 adds ``config.toml``
and the manifest and renames the directory to ``step-N/``. So a ``step-N`` directory exists only
once complete; one whose manifest does not verify (flipped bytes, truncated or deleted files) is
damaged. `latest_checkpoint` returns the newest directory with a manifest;
`verify_checkpoint` checks it (collective: the ranks share the hashing). The same code runs on
one process (no process group) and on many.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from densetrain.checkpoint import collective, objstore
from densetrain.checkpoint.manifest import (
    MANIFEST_FILE,
    Damage,
    check_hashes,
    check_sizes,
    read_manifest,
    share_of,
)
from densetrain.checkpoint.safe_pickle import read_dcp_metadata, safe_dcp_load
from densetrain.checkpoint.state import RNGState
from densetrain.errors import DamagedFileError, UserError

COMPLETE_MARKER = MANIFEST_FILE
"""The file whose presence makes a ``step-N`` directory a complete checkpoint."""
CONFIG_FILE = "config.toml"
_NAME_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointShapeError(UserError):
    """The checkpoint holds a tensor whose shape differs from the model's (another model)."""


class NonFiniteStateError(CheckpointError):
    """A model tensor holds NaN or inf; such a state is never saved."""


class CheckpointDamagedError(CheckpointError, DamagedFileError):
    """A checkpoint's files do not match its manifest; ``damage`` lists each bad file (an input
    error to the CLI: one message naming the files, exit 2)."""

    def __init__(self, path: Path, damage: list[Damage], hint: str = "") -> None:
        self.path = path
        self.damage = damage
        super().__init__(f"checkpoint {path} is damaged: " + "; ".join(map(str, damage))
                         + (f"; {hint}" if hint else ""))


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a checkpoint directory named ``step-N``, else None."""
    match = _NAME_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a finished checkpoint (its manifest is present; see
    `verify_checkpoint` for whether the files match it)."""
    if objstore.is_remote(path):
        return objstore.has_manifest(str(path))
    return (Path(path) / COMPLETE_MARKER).is_file()


def checkpoint_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory under ``directory`` as ``(step, path)``, oldest first,
    complete or not: the candidates a resume verifies (``.tmp`` and set-aside ones excluded).
    Under a URL (objstore.py) the paths are URL strings."""
    if objstore.is_remote(directory):
        return objstore.checkpoint_dirs(str(directory))
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = checkpoint_step(child)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``directory`` as ``(step, path)``, oldest first."""
    if objstore.is_remote(directory):
        return objstore.list_checkpoints(str(directory))
    return [(step, path) for step, path in checkpoint_dirs(directory) if is_complete(path)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def flatten_tree(tree: Mapping[str, Any] | list, prefix: str = "") -> dict[str, Any]:
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
            flat.update(flatten_tree(value, name + "."))
        else:
            flat[name] = value
    return flat


def materialise(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every Stateful entry replaced by its ``state_dict()``."""
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted paths."""
    if keep_last <= 0:
        raise UserError(f"checkpoint.keep_last must be >= 1 to prune, got {keep_last}")
    if objstore.is_remote(directory):
        return objstore.prune(str(directory), keep_last)
    doomed = [path for _, path in list_checkpoints(directory)[:-keep_last]]
    for path in doomed:
        delete_checkpoint(path)
    return doomed


def delete_checkpoint(path: str | os.PathLike) -> None:
    """Delete one checkpoint, on a disk or under a URL: its manifest first, so that a
    half-deleted one is never taken as complete."""
    if objstore.is_remote(path):
        objstore.remove(str(path))
        return
    (Path(path) / COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def checkpoint_keys(path: str | os.PathLike) -> frozenset[str]:
    """The flattened state keys checkpoint ``path`` holds (``model.…``, ``optim.…``), from its
    DCP metadata (read through the restricted unpickler): what schema migrations ask."""
    from densetrain.checkpoint.safe_pickle import read_dcp_metadata

    return frozenset(read_dcp_metadata(path).state_dict_metadata)


def newest_at_most(directory: str | os.PathLike, step: int) -> tuple[int, Path] | None:
    """The newest complete checkpoint of step <= ``step`` as ``(step, path)``, or None: where a
    rollback to ``step`` lands."""
    eligible = [(s, p) for s, p in list_checkpoints(directory) if s <= step]
    return eligible[-1] if eligible else None


def remove_checkpoints_after(directory: str | os.PathLike, step: int, *,
                             is_main: bool) -> list[Path]:
    """Delete the complete checkpoints after ``step`` (a rollback abandoned their trajectory: a
    later save of the same step must not find them); ``is_main`` deletes, every caller gets
    the list. The caller holds the other ranks until it is done (a barrier)."""
    doomed = [p for s, p in list_checkpoints(directory) if s > step]
    if is_main:
        for path in doomed:
            delete_checkpoint(path)
    return doomed


def set_aside(path: str | os.PathLike, reason: str) -> Path:
    """Rename checkpoint ``path`` to ``<name>.<reason>`` (``.<reason>-2``, ... when taken) so
    that it is never picked again but stays on disk for inspection; return the new path."""
    path = Path(path)
    target = path.with_name(f"{path.name}.{reason}")
    suffix = 2
    while target.exists():
        target = path.with_name(f"{path.name}.{reason}-{suffix}")
        suffix += 1
    os.replace(path, target)
    return target


def verify_checkpoint(path: str | os.PathLike, group: Any = None) -> list[Damage]:
    """What is wrong with checkpoint ``path`` against its manifest; empty when it verifies.

    Collective over ``group``: every rank checks the sizes and streams its share of the files
    through SHA-256, and every rank returns the same list. Under a URL rank 0 reads every
    object back and the others take its answer.
    """
    if objstore.is_remote(path):
        local = ([(d.file, d.problem) for d in objstore.verify(str(path))]
                 if collective.rank() == 0 else None)
        return [Damage(file=f, problem=p) for f, p in collective.gather_all(local, group)[0]]
    path = Path(path)
    manifest, unreadable = read_manifest(path)
    if unreadable is not None:
        return [unreadable]
    damage = check_sizes(path, manifest)
    if not damage:
        names = sorted(manifest["files"])
        mine = share_of(names, collective.rank(), collective.world_size())
        local = [(d.file, d.problem) for d in check_hashes(path, manifest, mine)]
        found = sorted(x for part in collective.gather_all(local, group) for x in part)
        damage = [Damage(file=f, problem=p) for f, p in found]
    return damage


def read_checkpoint_config(path: str | os.PathLike) -> str:
    """The resolved job config TOML stored in checkpoint ``path``."""
    if objstore.is_remote(path):
        text = objstore.read_text(str(path), CONFIG_FILE)
        if text is None:
            raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}")
        return text
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}")
    return config_path.read_text(encoding="utf-8")


def checkpoint_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shapes of every tensor stored in checkpoint ``path`` (from DCP metadata)."""
    metadata = read_dcp_metadata(path)
    return {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def _check_against_metadata(tree: Mapping[str, Any], path: Path) -> None:
    metadata = read_dcp_metadata(path).state_dict_metadata
    for name, value in flatten_tree(tree).items():
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


def load_checkpoint(
    path: str | os.PathLike, state: Mapping[str, Any], *, verify: bool = True
) -> None:
    """Load checkpoint ``path`` into the Stateful tree ``state`` in place (collective).

    With ``verify`` (default) the files are checked against the manifest first and a damaged
    checkpoint raises `CheckpointDamagedError` naming each bad file; pass False only for a
    checkpoint just verified. Every tensor's shape is checked against the checkpoint metadata
    next; a mismatch raises `CheckpointShapeError` naming the tensor before any value changes.
    """
    path = str(path) if objstore.is_remote(path) else Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})")
    if verify:
        damage = verify_checkpoint(path)
        if damage:
            raise CheckpointDamagedError(path, damage)
    stored = read_dcp_metadata(path).state_dict_metadata
    for key, value in state.items():
        if hasattr(value, "use_checkpoint_layout"):  # an entry whose layout has changed
            value.use_checkpoint_layout(key, set(stored))
        if isinstance(value, RNGState):
            prefix = f"{key}.rank"
            value.available_ranks = {
                int(k[len(prefix) :]) for k in stored if k.startswith(prefix)
            }
    tree = materialise(state)
    _check_against_metadata(tree, path)
    # Restricted metadata unpickler and weights-only non-tensor values: loading never runs code
    # from the checkpoint's pickles (checkpoint/safe_pickle.py).
    safe_dcp_load(tree, path)
    for key, value in state.items():
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(tree[key])
