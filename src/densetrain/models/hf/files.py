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
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from densetrain.errors import DamagedFileError, UserError, UserFileExistsError

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
    """Map each tensor name to the safetensors file holding it (via the index when sharded).

    The index's ``weight_map`` values must be plain file names in ``directory``: a path that
    would read a file elsewhere (``../x``, ``/abs``) is refused, naming the index and the key.
    """
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        if not isinstance(index.get("weight_map"), dict):
            raise UserError(f"{index_path} has no 'weight_map' object (tensor name -> file)")
        files = {}
        for name, file in index["weight_map"].items():
            if (not isinstance(file, str) or not file or "/" in file or "\\" in file
                    or file in (".", "..") or Path(file).name != file):
                raise UserError(
                    f"{index_path}: weight_map[{name!r}] is {file!r}; each value must be the "
                    "plain name of a safetensors file in the same directory (no path "
                    "separators or '..')"
                )
            files[name] = directory / file
        for path in sorted(set(files.values())):
            if not path.is_file():
                name = min(n for n, p in files.items() if p == path)
                raise UserError(f"{index_path}: weight_map[{name!r}] names shard {path.name}, "
                                f"which does not exist in {directory}")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as handle:
            return {name: single for name in handle.keys()}
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise UserError(
        f"{directory} holds no {SINGLE_FILE} or {INDEX_FILE} (found: {found}); only safetensors "
        "checkpoints are read"
    )


def tensor_specs(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and safetensors dtype code (``F32``, ``BF16``, ...) of every tensor, read from the
    file headers only (no tensor data)."""
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(set(files.values())):
        with open_safetensors(path) as handle:
            for name in handle.keys():
                if files.get(name) == path:
                    meta = handle.get_slice(name)
                    specs[name] = (tuple(meta.get_shape()), meta.get_dtype())
    return specs


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Shapes of every tensor, read from the file headers only (no tensor data)."""
    return {name: shape for name, (shape, _) in tensor_specs(files).items()}


_WEIGHT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                  "BF16": torch.bfloat16}


def weight_dtype(dtypes: dict[str, str], source: Path) -> torch.dtype:
    """The one dtype a model is loaded in, from the safetensors dtype code of each weight.

    Every weight must be floating point (F32, F16, BF16 or F64): ``UserError`` names the first
    that is not. Weights of one dtype keep it; mixed floating dtypes (e.g. bf16 weights beside
    fp32 norms) are all loaded as the widest of them, which loses nothing (F16 with BF16 gives
    F32).
    """
    for name, code in sorted(dtypes.items()):
        if code not in _WEIGHT_DTYPES:
            raise UserError(
                f"{source}: tensor {name!r} is stored as {code}; model weights must be floating "
                f"point ({', '.join(_WEIGHT_DTYPES)}), so this is not a checkpoint densetrain "
                "can load (quantized checkpoints are not supported)"
            )
    common = None
    for code in set(dtypes.values()):
        dtype = _WEIGHT_DTYPES[code]
        common = dtype if common is None else torch.promote_types(common, dtype)
    return common or torch.float32


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

    An existing non-empty ``target`` raises ``FileExistsError`` unless ``overwrite``, and even
    then only a model directory (one holding ``config.json``, as every directory written here
    does) is replaced: ``--overwrite`` pointed at a run, a dataset or a home directory by
    mistake deletes nothing.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise UserFileExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise UserFileExistsError(
                f"{target} exists and is not empty; choose another directory or replace it "
                "with --overwrite (overwrite=True in Python)"
            )
        if not (target / "config.json").is_file():
            raise UserFileExistsError(
                f"{target} is not a model directory (no config.json), so --overwrite does not "
                "replace it: it replaces only an earlier output of this command; choose another "
                "output directory"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        _apply_umask_permissions(tmp)
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


def check_output_apart(source: Path, out: Path, *, inside_ok: bool = False) -> None:
    """``UserError`` when the output directory ``out`` is the directory ``source`` it is written
    from or holds it (replacing it would delete the source), or lies inside it unless
    ``inside_ok`` (a directory added inside a training checkpoint no longer matches its
    manifest)."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src or dst in src.parents or (src in dst.parents and not inside_ok):
        where = ("is" if dst == src else "holds" if dst in src.parents else "lies inside")
        raise UserError(
            f"the output {out} {where} the source {source}; write the output to a directory "
            "outside the source"
        )


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _apply_umask_permissions(directory: Path) -> None:
    """Give ``directory`` (made 0700 by ``mkdtemp``) and its files the permissions a plain
    ``mkdir``/``open`` would: 0777/0666 minus the process umask (0755/0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for child in directory.rglob("*"):
        child.chmod((0o777 if child.is_dir() else 0o666) & ~umask)


# ---------------------------------------------------------------------------- streaming
# safetensors' own writers (save_file, save) take every tensor at once; a checkpoint larger than
# memory has to be written tensor by tensor, so the file layout (an 8-byte little-endian header
# length, a JSON header with dtype, shape and data_offsets per tensor, then the raw bytes; see
# the format description in the safetensors README) is written here, and read back with
# safetensors' safe_open to check it.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def torch_dtype_of(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``F32``, ``BF16``, ...)."""
    for dtype, name in _SAFETENSORS_DTYPES.items():
        if name == code:
            return dtype
    allowed = list(_SAFETENSORS_DTYPES.values())
    raise UserError(f"safetensors dtype {code!r} is not one of {allowed}")


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor that will be written later."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class StreamingSafetensorsWriter:
    """Write a (sharded) safetensors checkpoint whose tensors arrive one at a time, in any order.

    The headers are computed from ``specs`` up front (sharding as ``write_safetensors`` does),
    so each tensor is written at its final offset as soon as it is given and then released:
    memory holds one tensor, never the checkpoint. ``close()`` raises ``ValueError`` naming
    tensors that were never written, then writes the index of a sharded checkpoint.
    """

    def __init__(
        self, directory: Path, specs: dict[str, TensorSpec], max_shard_bytes: int
    ) -> None:
        if sys.byteorder != "little":
            raise ValueError("safetensors files are little-endian; this machine is not")
        unknown = sorted({str(s.dtype) for s in specs.values()} -
                         {str(d) for d in _SAFETENSORS_DTYPES})
        if unknown:
            raise ValueError(f"dtypes {unknown} cannot be stored in safetensors")
        self.directory = Path(directory)
        self.specs = dict(specs)
        metas = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
        shards = [list(shard) for shard in shard_tensors(metas, max_shard_bytes)]
        self.file_names = (
            [SINGLE_FILE] if len(shards) == 1
            else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                  for i in range(1, len(shards) + 1)]
        )
        self._fds: list[int] = []
        self._location: dict[str, tuple[int, int]] = {}
        self._file_of: dict[str, str] = {}
        for file_name, names in zip(self.file_names, shards, strict=True):
            self._open_shard(self.directory / file_name, names)
        self._pending = set(specs)

    def _open_shard(self, path: Path, names: list[str]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            spec = self.specs[name]
            header[name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._fds.append(fd)
        _write_all(fd, len(text).to_bytes(8, "little") + text, 0)
        data_start = 8 + len(text)
        os.ftruncate(fd, data_start + offset)
        for name in names:
            start = header[name]["data_offsets"][0]  # type: ignore[index]
            self._location[name] = (fd, data_start + start)
            self._file_of[name] = path.name

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (exactly the shape and dtype of its spec) at its place."""
        if name not in self._pending:
            state = "already written" if name in self.specs else "not in the checkpoint plan"
            raise ValueError(f"tensor {name!r} is {state}")
        spec = self.specs[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"tensor {name!r}: expected {list(spec.shape)} {spec.dtype}, got "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        fd, offset = self._location[name]
        _write_all(fd, memoryview(data), offset)
        self._pending.discard(name)

    def close(self) -> None:
        """Flush and close every shard, then write the index of a sharded checkpoint."""
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        if self._pending:
            missing = sorted(self._pending)
            raise ValueError(f"tensors never written: {missing[:5]} ({len(missing)} in all)")
        if len(self.file_names) > 1:
            total = sum(s.nbytes for s in self.specs.values())
            index = {"metadata": {"total_size": total}, "weight_map": self._file_of}
            write_json(self.directory / INDEX_FILE, index)

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            return
        self.close()


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
