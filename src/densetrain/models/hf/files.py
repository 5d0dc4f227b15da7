"""Reading and atomically writing safetensors checkpoint directories (sharded or not)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (via the index when sharded)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = {name: directory / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ValueError(f"{index_path} names shard {path.name}, which does not exist")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
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
        with safe_open(path, framework="pt") as handle:
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
        with safe_open(path, framework="pt") as handle:
            for name in wanted:
                tensors[name] = handle.get_tensor(name)
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
        save_file(shards[0], directory / SINGLE_FILE, metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


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
        raise FileExistsError(f"{target} exists and is not empty (pass overwrite=True)")
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
