"""What an export reads: a training run, one of its checkpoints, or a densetrain model directory.

``open_source(path)`` accepts

- a run directory (``<run>/checkpoints/step-N``) or a checkpoint directory holding ``step-N``
  checkpoints: the newest one whose files match their manifest (``checkpoint/reading.py``; a
  damaged newer one is named on stderr),
- one training checkpoint (``step-N`` with DCP shards, ``config.toml`` and ``manifest.json``),
  verified the same way, written by any layout (one process, FSDP, TP, PP: DCP stores global
  tensors),
- a densetrain model directory (``config.json`` with ``ModelConfig`` fields + safetensors).

For a training checkpoint the model config and the tokenizer come from the job config stored in
it, found as the run found it (``data.bundle.job_tokenizer``: the datasets' tokenizer
fingerprints checked). Nothing is prepared or trained here: a tokenizer that is no longer where
the job found it is an error naming the path and ``--tokenizer``. Every tensor read is checked
for NaN and inf.

Tensors are read one request at a time: ``read(names)`` loads exactly those model tensors from
the DCP checkpoint (``torch.distributed.checkpoint`` on this one process, no process group) or
from the safetensors files, so memory never holds the whole model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from densetrain.checkpoint.collective import quiet_single_process_notice
from densetrain.checkpoint.reading import open_training_checkpoint
from densetrain.checkpoint.safe_pickle import (
    SafeLoadPlanner,
    safe_reader,
)
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.files import TensorSpec

_MODEL_PREFIX = "model."  # the checkpoint tree entry that holds the model (checkpoint/state.py)


@dataclass(frozen=True)
class ExportSource:
    """A model to export: its config, stored tensors, a reader and the tokenizer, if known."""

    path: Path
    kind: str  # "checkpoint" or "model"
    config: ModelConfig
    specs: dict[str, TensorSpec]
    read: Callable[[tuple[str, ...]], dict[str, torch.Tensor]]
    tokenizer: Tokenizer | None


def _checkpoint_source(found, tokenizer: Tokenizer | None) -> ExportSource:
    """The source of verified training checkpoint ``found`` (`TrainingCheckpoint`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from densetrain.data.bundle import job_tokenizer

    checkpoint = found.path
    explicit = tokenizer is not None
    tokenizer = tokenizer or job_tokenizer(found.job.data, source=checkpoint)
    config = found.model_config(tokenizer, explicit=explicit)
    metadata = found.metadata
    specs = {
        key[len(_MODEL_PREFIX):]: TensorSpec(tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }

    def read(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        wanted = {
            _MODEL_PREFIX + name: torch.empty(specs[name].shape, dtype=specs[name].dtype)
            for name in names
        }
        # No process group: DCP reads the requested entries on this process, whatever layout
        # wrote them, each into its preallocated full tensor (and says so in a warning).
        quiet_single_process_notice()
        dcp.load(wanted, storage_reader=safe_reader(checkpoint),
                 planner=SafeLoadPlanner(), no_dist=True)
        return {name: wanted[_MODEL_PREFIX + name] for name in names}

    return ExportSource(path=checkpoint, kind="checkpoint", config=config, specs=specs,
                        read=read, tokenizer=tokenizer)


def _model_dir_source(directory: Path, tokenizer: Tokenizer | None) -> ExportSource:
    from densetrain.models.hf.files import (
        checkpoint_files,
        read_json,
        read_tensors,
        tensor_specs,
        torch_dtype_of,
    )

    data = read_json(directory / "config.json")
    if "model_type" in data:
        raise UserError(
            f"{directory} is already a Hugging Face checkpoint (config.json has model_type="
            f"{data['model_type']!r}); export reads densetrain runs, checkpoints and model "
            "directories"
        )
    files = checkpoint_files(directory)
    specs = {name: TensorSpec(shape, torch_dtype_of(code))
             for name, (shape, code) in tensor_specs(files).items()}
    if tokenizer is None and (directory / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    return ExportSource(path=directory, kind="model", config=ModelConfig.from_dict(
                            data, source=str(directory / "config.json")),
                        specs=specs, read=lambda names: read_tensors(files, set(names)),
                        tokenizer=tokenizer)



def open_source(path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None
                ) -> ExportSource:
    """The ``ExportSource`` at ``path`` (see the module docstring); ``ValueError`` otherwise."""
    from densetrain.checkpoint.objstore import check_reachable, is_remote

    if is_remote(path):  # a training checkpoint on an object store (checkpoint/objstore.py)
        check_reachable(str(path))
        explicit = load_tokenizer(tokenizer) if tokenizer else None
        checkpoint = open_training_checkpoint(str(path))
        if checkpoint is None:
            raise UserError(f"{path} holds no training checkpoint (no step-N prefix in it or "
                             "in its checkpoints/)")
        source = _checkpoint_source(checkpoint, explicit)
        return dataclasses.replace(source, read=_finite_reader(source))
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory (a run, checkpoint or model directory)")
    explicit = load_tokenizer(tokenizer) if tokenizer else None
    if (directory / "config.json").is_file():
        source = _model_dir_source(directory, explicit)
        return dataclasses.replace(source, read=_finite_reader(source))
    checkpoint = open_training_checkpoint(directory)
    if checkpoint is None:
        raise UserError(
            f"{directory} is not a run directory (with checkpoints/), a checkpoint directory, a "
            "complete training checkpoint (step-N with COMPLETE) or a densetrain model directory "
            "(with config.json)"
        )
    source = _checkpoint_source(checkpoint, explicit)
    return dataclasses.replace(source, read=_finite_reader(source))


def _finite_reader(source: ExportSource) -> Callable[[tuple[str, ...]], dict[str, torch.Tensor]]:
    """``source.read`` that refuses a tensor holding NaN or inf, naming it: such weights are
    never exported."""
    from densetrain.models.hf.files import check_finite

    def read(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        tensors = source.read(names)
        check_finite(tensors, source.path)
        return tensors

    return read
