"""Load a model and its tokenizer for evaluation or generation from any kind of directory.

``MODEL`` may be:

- a densetrain model directory (``config.json`` with ``ModelConfig`` fields + safetensors,
  ``densetrain.models.hf.native``);
- a Hugging Face checkpoint directory (``config.json`` with ``model_type``);
- a training checkpoint (``step-N/`` with DCP shards, ``config.toml`` and ``COMPLETE``), a
  checkpoint directory holding several (the latest complete one is used), or a run directory
  with ``checkpoints/`` inside. The model is rebuilt from the stored job config and only the
  model entry of the checkpoint is read.

The tokenizer is ``tokenizer`` when given, else ``tokenizer.json``/``tokenizer.model`` beside
the model; for a training checkpoint, the tokenizer the job trained with (``data.tokenizer``,
else the first dataset's, else the default corpus's).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from densetrain.checkpoint.manager import find_training_checkpoint
from densetrain.errors import DamagedFileError, UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` = the first GPU when there is one, else the CPU; otherwise the named device,
    checked as the trainer checks it (a ``ValueError`` naming ``--device`` when it is not a
    device or not there)."""
    from densetrain.train.device import resolve_device as resolve

    return resolve(name, field="--device")


def _tokenizer_beside(directory: Path):
    from densetrain.data.tokenizer import load_tokenizer

    for name in _TOKENIZER_NAMES:
        if (directory / name).is_file():
            return load_tokenizer(directory / name)
    return None


def _job_tokenizer(job):
    """The tokenizer a training job used (without preparing anything that already exists)."""
    from densetrain.data import ensure_default_corpus, load_metadata, load_tokenizer

    data = job.data
    if data.tokenizer:
        return load_tokenizer(data.tokenizer)
    if data.datasets:
        root = Path(data.datasets[0])
        return load_tokenizer(root / load_metadata(root)["tokenizer"]["file"])
    corpus = ensure_default_corpus(
        cache_dir=data.cache_dir, vocab_size=data.default_vocab_size,
        max_files=data.default_max_files, val_fraction=data.default_val_fraction,
    )
    return load_tokenizer(corpus / "tokenizer.json")


def _check_model_shapes(model_state: dict, metadata, checkpoint: Path) -> None:
    """Every model tensor must be in the checkpoint with the shape the stored config implies."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = metadata.state_dict_metadata
    for name, value in model_state.items():
        meta = stored.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise DamagedFileError(
                f"checkpoint {checkpoint} has no tensor 'model.{name}' that its config.toml "
                "implies; the checkpoint is damaged or its config.toml is not its own"
            )
        if tuple(meta.size) != tuple(value.shape):
            raise DamagedFileError(
                f"checkpoint {checkpoint}: tensor 'model.{name}' has shape {tuple(meta.size)}, "
                f"its config.toml implies {tuple(value.shape)}"
            )


def _load_checkpoint_model(checkpoint: Path, tokenizer):
    """The model of a training checkpoint, read without running anything from its files: the
    metadata through a restricted unpickler, non-tensor values as plain data only
    (``densetrain.checkpoint.safe_pickle``)."""
    from densetrain.checkpoint import ModelState
    from densetrain.checkpoint.safe_pickle import read_dcp_metadata, safe_dcp_load
    from densetrain.config import job_config_from_dict
    from densetrain.models import Transformer
    from densetrain.models.hf.files import check_finite

    config_path = checkpoint / "config.toml"
    if not config_path.is_file():
        raise DamagedFileError(f"checkpoint {checkpoint} has no config.toml; it is incomplete")
    try:
        config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{config_path} is not valid TOML ({error})") from error
    job = job_config_from_dict(config, source=str(config_path), validate=False)
    tokenizer = tokenizer or _job_tokenizer(job)
    metadata = read_dcp_metadata(checkpoint)
    with torch.device("meta"):
        model = Transformer(job.build_model_config(tokenizer.vocab_size))
    model.to_empty(device="cpu")
    state = ModelState(model)
    tree = {"model": state.state_dict()}
    _check_model_shapes(tree["model"], metadata, checkpoint)
    safe_dcp_load(tree, checkpoint)
    state.load_state_dict(tree["model"])
    check_finite(model.state_dict(), checkpoint)
    return model, tokenizer


def load_for_eval(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: torch.dtype | None = None,
):
    """``(model in eval mode on device, tokenizer)`` from a model, HF or checkpoint directory."""
    from densetrain.data.tokenizer import load_tokenizer
    from densetrain.models.hf import load_hf, load_model
    from densetrain.models.hf.native import is_model_dir

    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"model path {directory} is not a directory; give a model, Hugging Face "
                        "or training checkpoint directory")
    explicit = load_tokenizer(tokenizer) if tokenizer else None
    has_config = (directory / "config.json").is_file()
    checkpoint = None if has_config else find_training_checkpoint(directory)
    if checkpoint is not None:
        model, found = _load_checkpoint_model(checkpoint, explicit)
    elif (directory / "config.json").is_file():
        model = load_model(directory) if is_model_dir(directory) else load_hf(directory)
        found = explicit or _tokenizer_beside(directory)
    else:
        raise ValueError(
            f"{directory} is not a model directory (no config.json), a complete training "
            "checkpoint (step-N with COMPLETE) or a directory holding one"
        )
    if found is None:
        raise ValueError(
            f"no tokenizer.json or tokenizer.model beside {directory}; pass --tokenizer PATH"
        )
    if dtype is not None:
        model = model.to(dtype)
    return model.to(resolve_device(device)).eval(), found
