"""Reading and atomically writing safetensors checkpoint directories (sharded or not).

Only safetensors and JSON are read here: loading a model directory never unpickles anything,
so model and Hugging Face export directories are safe to take from others. A truncated or
damaged file, malformed JSON or a NaN/inf weight is refused with a message naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from densetrain.errors import DamagedFileError, UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def read_json(path: Path) -> dict:
    """A JSON object file; ``UserError`` naming the file, line and column when malformed."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        where = f"{path}:{error.lineno}:{error.colno}"
        raise UserError(f"{where}: malformed JSON ({error.msg})") from error
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not UTF-8 text, so not a JSON file ({error})") from error
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator:
    """``safe_open(path)``; a truncated or damaged file raises ``DamagedFileError`` naming it."""
    try:
        handle = safe_open(path, framework="pt")
    except SafetensorError as error:
        raise DamagedFileError(
            f"{path} is not a readable safetensors file ({error}); the file is truncated or "
            "damaged: download or convert it again"
        ) from error
    with handle:
        yield handle


def check_finite(tensors: dict[str, torch.Tensor], source: Path) -> None:
    """``UserError`` naming the first floating-point tensor holding NaN or inf."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UserError(
                f"{source}: tensor {name!r} holds {bad} NaN/inf values; a model with non-finite "
                "weights is refused (take an earlier checkpoint of the run)"
            )


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (via the index when sharded)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        if not isinstance(index.get("weight_map"), dict):
            raise UserError(f"{index_path} has no 'weight_map' object (tensor name -> file)")
        weight_map = index["weight_map"]
        files = {name: directory / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ValueError(f"{index_path} names shard {path.name}, which does not exist")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as handle:
            return {name: single for name in handle.keys()}
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise ValueError(
        f"{directory} holds no {SINGLE_FILE} or {INDEX_FILE} (found: {found}); only safetensors "
        "checkpoints are read"
    )


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Shapes of every tensor, read from the file headers only (no tensor data)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with open_safetensors(path) as handle:
            for name in handle.keys():
                if files.get(name) == path:
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def read_tensors(files: dict[str, Path], names: set[str]) -> dict[str, torch.Tensor]:
    """Load the tensors ``names`` (each from its file)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        wanted = [n for n, p in files.items() if p == path and n in names]
        if not wanted:
            continue
        with open_safetensors(path) as handle:
            for name in wanted:
                try:
                    tensors[name] = handle.get_tensor(name)
                except SafetensorError as error:
                    raise DamagedFileError(f"{path}: tensor {name!r} cannot be read ({error}); "
                                           "the file is damaged") from error
    check_finite(tensors, path.parent)
    return tensors


def shard_tensors(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets a
    shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_safetensors(
    directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> None:
    """Write ``model.safetensors`` or, past ``max_shard_bytes``, numbered shards plus the index."""
    metadata = {"format": "pt"}
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) == 1:
        _save_file(shards[0], directory / SINGLE_FILE, metadata)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, directory / file, metadata)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    """``safetensors.torch.save_file``; a full disk is raised as ``OSError(ENOSPC)`` naming it
    (safetensors reports every I/O error as its own ``SafetensorError``)."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as error:
        if "No space left" in str(error) or "os error 28" in str(error):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error
        raise OSError(errno.EIO, f"writing failed: {error}", str(path)) from error


def write_directory_atomically(
    target: Path, fill: Callable[[Path], None], *, overwrite: bool = False
) -> None:
    """Create directory ``target`` by calling ``fill(tmp)`` on a temporary sibling directory and
    renaming it into place, so ``target`` never appears half-written.

    An existing non-empty ``target`` raises ``FileExistsError`` unless ``overwrite``.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{target} exists and is not empty; choose another directory or replace it with "
            "--overwrite (overwrite=True in Python)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "previous")
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    except OSError as error:  # a full disk: nothing half-written, the target named
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(error.errno, error.strerror, str(target)) from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
