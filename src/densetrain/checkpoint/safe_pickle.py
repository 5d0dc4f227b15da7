"""Reading `torch.distributed.checkpoint` (DCP) directories without running code from them.

DCP stores two kinds of pickles: the ``.metadata`` file (a pickled ``Metadata`` tree, read by
``FileSystemReader.read_metadata`` with plain ``pickle.load``) and every non-tensor value of the
state (ints, floats, strings, lists: ``torch.save``'d and read by
``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``). Either would run
whatever a ``__reduce__`` in a file from someone else names. Here:

* ``.metadata`` goes through `RestrictedUnpickler`, which admits only the classes DCP writes
  there (`DCP_METADATA_CLASSES`, plus torch dtypes); anything else raises `UnsafeFileError`;
* non-tensor values go through ``torch.load(weights_only=True)`` — torch's own restricted
  unpickler of plain data — in `SafeLoadPlanner`;
* tensors are already read by DCP with ``weights_only=True``.

`read_dcp_metadata` and `safe_dcp_load` are the functions loaders call; `SafeFileSystemReader`
and `SafeLoadPlanner` plug the same rules into any other ``dcp.load`` call. A restricted
unpickler is written here because DCP offers none for its metadata (its reader calls
``pickle.load``); the allow-list is small and fixed by what DCP's ``metadata.py`` defines.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from densetrain.checkpoint.collective import quiet_single_process_notice
from densetrain.errors import DamagedFileError, UnsafeFileError, unwrap_error

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
DCP_METADATA_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )}
    | {(_DCP_FILESYSTEM, "_StorageInfo"), (_DCP_FILESYSTEM, "_StoragePrefix")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath",
                                "PureWindowsPath")}
    | {("collections", "OrderedDict")}
)


def _is_torch_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `DCP_METADATA_CLASSES` and torch dtypes."""

    def __init__(self, file: io.BufferedIOBase, *, source: str | os.PathLike) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """The class ``module.name`` when allowed; `UnsafeFileError` otherwise."""
        if (module, name) in DCP_METADATA_CLASSES or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeFileError(
            f"{self.source}: refusing to load {module}.{name}: a DCP checkpoint's metadata holds "
            "only torch.distributed.checkpoint metadata classes, so this file was not written "
            "by a checkpoint save (or was altered); nothing from it was run"
        )


def unpickle_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """Read one DCP ``.metadata`` file through `RestrictedUnpickler`.

    Raises `UnsafeFileError` for a disallowed class and `DamagedFileError` for a missing,
    truncated or garbage file.
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedFileError(f"{path} is missing: the checkpoint is incomplete or damaged")
    with open(path, "rb") as f:
        try:
            metadata = RestrictedUnpickler(f, source=path).load()
        except UnsafeFileError:
            raise
        except Exception as error:  # pickle raises many types on garbage input
            detail = ascii(str(error))[1:-1]
            detail = detail if len(detail) <= 80 else detail[:80] + "..."
            raise DamagedFileError(
                f"{path} cannot be read as checkpoint metadata ({type(error).__name__}: "
                f"{detail}); the file is truncated or damaged"
            ) from error
    if not isinstance(metadata, Metadata):
        raise DamagedFileError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def _unpickle_remote(url: str) -> Metadata:
    """`unpickle_dcp_metadata` of the object at fsspec ``url``."""
    from densetrain.checkpoint.objstore import open_stream

    try:
        stream = open_stream(url)
    except FileNotFoundError:
        raise DamagedFileError(f"{url} is missing: the checkpoint is incomplete or damaged"
                               ) from None
    with stream:
        try:
            metadata = RestrictedUnpickler(io.BytesIO(stream.read()), source=url).load()
        except UnsafeFileError:
            raise
        except Exception as error:
            raise DamagedFileError(f"{url} cannot be read as checkpoint metadata "
                                   f"({type(error).__name__}); the object is damaged") from error
    if not isinstance(metadata, Metadata):
        raise DamagedFileError(f"{url} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def read_dcp_metadata(checkpoint: str | os.PathLike) -> Metadata:
    """The ``Metadata`` of DCP checkpoint directory ``checkpoint`` (restricted unpickling); a
    ``scheme://`` URL is read through fsspec."""
    from densetrain.checkpoint.objstore import is_remote, join

    if is_remote(checkpoint):
        return _unpickle_remote(join(str(checkpoint), METADATA_FILE))
    return unpickle_dcp_metadata(Path(checkpoint) / METADATA_FILE)


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses `RestrictedUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, as the parent class returns it, without ``pickle.load``."""
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = unpickle_dcp_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


REMOTE_READ_BLOCK_BYTES = 16 * 2**20
"""Block size of the cache a shard object is read through on an object store."""
REMOTE_READ_BLOCKS_KEPT = 8
"""Blocks that cache keeps (with the block size, the most a reader holds: 128 MiB)."""


def _offset_order(plan: Any, storage_data: dict) -> Any:
    """``plan`` with its read items in storage order: by file, then by offset in the file."""
    import dataclasses

    def where(item: ReadItem) -> tuple[str, int]:
        info = storage_data[item.storage_index]
        return str(info.relative_path), int(info.offset)

    return dataclasses.replace(plan, items=sorted(plan.items, key=where))


def _safe_fsspec_reader(url: str) -> Any:
    """DCP's ``FsspecReader`` for ``url`` whose ``read_metadata`` uses `RestrictedUnpickler`,
    and which reads each shard object in one forward pass.

    DCP's reader reads the items of a load plan in plan order (the model's), while its writer
    stores them largest first, and it reads each tensor with ``torch.load`` on a slice of one
    stream (the slice's zip directory at its end first, then its data). Through s3fs's default
    cache, one read-ahead window, that re-fetched blocks: 2.9 times the shard's bytes for a
    247 MB checkpoint (benchmarks/RESULTS.md, "Checkpoints on object storage"). Here the items
    are read in offset order, through a cache of `REMOTE_READ_BLOCKS_KEPT` blocks of
    `REMOTE_READ_BLOCK_BYTES`, so that each block is fetched once. Written here because DCP
    leaves this open (a TODO in ``FileSystemReader.read_data``) and fsspec cannot know the
    access pattern.
    """
    from contextlib import contextmanager

    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader

    class BlockCachedFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str):
            if mode != "rb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with self.fs.open(os.fspath(path), "rb", cache_type="blockcache",
                              block_size=REMOTE_READ_BLOCK_BYTES,
                              cache_options={"maxblocks": REMOTE_READ_BLOCKS_KEPT}) as stream:
                yield stream

    class SafeFsspecReader(FsspecReader):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = BlockCachedFileSystem()
            self.path = self.fs.init_path(path)

        def read_data(self, plan: Any, planner: Any) -> Any:
            return super().read_data(_offset_order(plan, self.storage_data), planner)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            metadata = _unpickle_remote(f"{str(self.path).rstrip('/')}/{name}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFsspecReader(url)


def safe_reader(checkpoint: str | os.PathLike) -> Any:
    """The restricted DCP storage reader of ``checkpoint``: `SafeFileSystemReader` for a local
    directory, the fsspec one for a ``scheme://`` URL."""
    from densetrain.checkpoint.objstore import is_remote

    if is_remote(checkpoint):
        return _safe_fsspec_reader(str(checkpoint))
    return SafeFileSystemReader(str(checkpoint))


def _first_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only message that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported" in line or "WeightsUnpickler" in line]
    return (named or lines or ["not plain data"])[0]


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle one non-tensor value as plain data and place it like the parent class."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeFileError(
                f"checkpoint entry {fqn!r} holds a pickled object that is not plain data "
                f"({_first_reason(error)}); refused, nothing from it was run"
            ) from error
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def safe_dcp_load(state_dict: dict[str, Any], checkpoint: str | os.PathLike) -> None:
    """``dcp.load(state_dict)`` from ``checkpoint`` with `SafeFileSystemReader` and
    `SafeLoadPlanner` (collective when a process group is up).

    A refused pickle raises `UnsafeFileError`; a shard that cannot be read raises
    `DamagedFileError` naming the checkpoint.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    no_dist = not (dist.is_available() and dist.is_initialized())
    read_dcp_metadata(checkpoint)  # its own errors first (DCP folds them into an assertion)
    try:
        quiet_single_process_notice()
        dcp.load(
            state_dict,
            storage_reader=safe_reader(checkpoint),
            planner=SafeLoadPlanner(),
            no_dist=no_dist,
        )
    except CheckpointException as error:
        cause = unwrap_error(error)
        if isinstance(cause, (UnsafeFileError, DamagedFileError)):
            raise cause from None
        raise DamagedFileError(
            f"checkpoint {checkpoint} cannot be read ({type(cause).__name__}: {cause}); a "
            "shard is truncated or damaged"
        ) from cause
