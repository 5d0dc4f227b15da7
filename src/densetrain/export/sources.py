"""What an export reads: a training run, one of its checkpoints, or a densetrain model directory.

``open_source(path)`` accepts

- a run directory (``<run>/checkpoints/step-N``: the latest complete checkpoint is used),
- a checkpoint directory holding ``step-N`` checkpoints (the latest complete one),
- one complete training checkpoint (``step-N`` with ``COMPLETE``, DCP shards and
  ``config.toml``), written by any layout (one process, FSDP, TP, PP: DCP stores global tensors),
- a densetrain model directory (``config.json`` with ``ModelConfig`` fields + safetensors).

For a training checkpoint the model config and the tokenizer come from the job config stored in
it: ``data.tokenizer``, else the first prepared dataset's tokenizer, else the default corpus's
(in the cache it was prepared into). Nothing is prepared or trained here: a tokenizer that is no
longer where the job found it is an error naming the path and ``--tokenizer``.

Tensors are read one request at a time: ``read(names)`` loads exactly those model tensors from
the DCP checkpoint (``torch.distributed.checkpoint`` on this one process, no process group) or
from the safetensors files, so memory never holds the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from densetrain.checkpoint.collective import quiet_single_process_notice
from densetrain.checkpoint.manager import find_training_checkpoint
from densetrain.checkpoint.safe_pickle import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
)
from densetrain.data.tokenizer import Tokenizer, load_tokenizer
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


def _default_corpus_tokenizer(data) -> Path:
    """Where ``ensure_default_corpus`` put the default corpus's tokenizer for ``data``."""
    from densetrain.data.default_corpus import default_corpus_dir

    directory = default_corpus_dir(cache_dir=data.cache_dir, vocab_size=data.default_vocab_size,
                                   max_files=data.default_max_files,
                                   val_fraction=data.default_val_fraction)
    return directory / "tokenizer.json"


def job_tokenizer_path(job) -> Path:
    """The tokenizer file a training job used, without preparing anything."""
    from densetrain.data import load_metadata

    data = job.data
    if data.tokenizer:
        return Path(data.tokenizer)
    if data.datasets:
        root = Path(data.datasets[0])
        return root / load_metadata(root)["tokenizer"]["file"]
    return _default_corpus_tokenizer(data)


def _checkpoint_source(checkpoint: Path, tokenizer: Tokenizer | None) -> ExportSource:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from densetrain.checkpoint import read_checkpoint_config
    from densetrain.config import job_config_from_dict

    job = job_config_from_dict(
        tomllib.loads(read_checkpoint_config(checkpoint)),
        source=f"{checkpoint}/config.toml", validate=False,
    )
    if tokenizer is None:
        path = job_tokenizer_path(job)
        if not path.is_file():
            raise ValueError(
                f"the tokenizer of checkpoint {checkpoint} is missing: its config.toml points "
                f"to {path}, which does not exist; pass --tokenizer PATH (the tokenizer.json "
                "the run trained with)"
            )
        tokenizer = load_tokenizer(path)
    metadata = read_dcp_metadata(checkpoint).state_dict_metadata
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
        dcp.load(wanted, storage_reader=SafeFileSystemReader(str(checkpoint)),
                 planner=SafeLoadPlanner(), no_dist=True)
        return {name: wanted[_MODEL_PREFIX + name] for name in names}

    return ExportSource(path=checkpoint, kind="checkpoint",
                        config=job.build_model_config(tokenizer.vocab_size), specs=specs,
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
        raise ValueError(
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
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory (a run, checkpoint or model directory)")
    explicit = load_tokenizer(tokenizer) if tokenizer else None
    if (directory / "config.json").is_file():
        return _model_dir_source(directory, explicit)
    checkpoint = find_training_checkpoint(directory)
    if checkpoint is None:
        raise ValueError(
            f"{directory} is not a run directory (with checkpoints/), a checkpoint directory, a "
            "complete training checkpoint (step-N with COMPLETE) or a densetrain model directory "
            "(with config.json)"
        )
    return _checkpoint_source(checkpoint, explicit)
