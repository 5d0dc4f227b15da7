"""Load a model and its tokenizer for evaluation or generation from any kind of directory.

``MODEL`` may be:

- a densetrain model directory (``config.json`` with ``ModelConfig`` fields + safetensors,
  ``densetrain.models.hf.native``);
- a Hugging Face checkpoint directory (``config.json`` with ``model_type``);
- a training checkpoint (``step-N/`` with DCP shards, ``config.toml`` and ``manifest.json``), a
  checkpoint directory holding several, or a run directory with ``checkpoints/`` inside: the
  newest checkpoint whose files match their manifest is used (``checkpoint/reading.py``; a
  damaged newer one is named on stderr). The model is rebuilt from the stored job config, its
  tensors must be exactly the ones that config implies, and only the model entry is read.

The tokenizer is ``tokenizer`` when given, else ``tokenizer.json``/``tokenizer.model`` beside
the model; for a training checkpoint, the tokenizer the job trained with, found as the run
found it (``data.bundle.job_tokenizer``: dataset fingerprints checked, nothing prepared).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from densetrain.checkpoint.reading import open_training_checkpoint
from densetrain.errors import DamagedFileError, UserError

_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model")
_MODEL = "model."  # the checkpoint tree entry that holds the model (checkpoint/state.py)


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


def _check_model_tensors(model_state: dict, found) -> None:
    """The checkpoint's model tensors must be exactly those the stored config implies, each with
    its shape: a missing, extra or mis-shaped one means the config.toml is not its own."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from densetrain.models.hf.shapes import shape_mismatches

    stored = {key[len(_MODEL):]: tuple(meta.size) for key, meta in found.metadata.items()
              if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
    expected = {name: tuple(value.shape) for name, value in model_state.items()}
    missing, extra, misshaped = shape_mismatches(expected, stored)
    for name in expected:
        if name in missing:
            raise DamagedFileError(
                f"checkpoint {found.path} has no tensor '{_MODEL}{name}' that its config.toml "
                "implies; the checkpoint is damaged or its config.toml is not its own"
            )
        if name in misshaped:
            raise DamagedFileError(
                f"checkpoint {found.path}: tensor '{_MODEL}{name}' has shape {stored[name]}, "
                f"its config.toml implies {expected[name]}"
            )
    if extra:
        extra = sorted(_MODEL + name for name in extra)
        raise DamagedFileError(
            f"checkpoint {found.path} holds model tensors its config.toml does not imply "
            f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); its config.toml is "
            "not its own"
        )


def _load_checkpoint_model(found, explicit):
    """The model of verified training checkpoint ``found``, read without running anything from
    its files: the metadata through a restricted unpickler, non-tensor values as plain data only
    (``densetrain.checkpoint.safe_pickle``)."""
    from densetrain.checkpoint import ModelState
    from densetrain.checkpoint.safe_pickle import safe_dcp_load
    from densetrain.data.bundle import job_tokenizer
    from densetrain.models import Transformer
    from densetrain.models.hf.files import check_finite

    tokenizer = explicit or job_tokenizer(found.job.data, source=found.path)
    config = found.model_config(tokenizer, explicit=explicit is not None)
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    state = ModelState(model)
    tree = {"model": state.state_dict()}
    _check_model_tensors(tree["model"], found)
    safe_dcp_load(tree, found.path)
    state.load_state_dict(tree["model"])
    check_finite(model.state_dict(), found.path)
    return model, tokenizer


def load_for_eval(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: torch.dtype | None = None,
):
    """``(model in eval mode on device, tokenizer)`` from a model, HF or checkpoint directory
    (a training checkpoint may be an fsspec URL, ``s3://bucket/run``)."""
    from densetrain.checkpoint.objstore import check_reachable, is_remote
    from densetrain.data.tokenizer import load_tokenizer
    from densetrain.models.hf import load_hf, load_model
    from densetrain.models.hf.native import is_model_dir

    if is_remote(path):  # a training checkpoint on an object store (checkpoint/objstore.py)
        check_reachable(str(path))
        checkpoint = open_training_checkpoint(str(path))
        if checkpoint is None:
            raise UserError(f"{path} holds no training checkpoint (no step-N prefix in it or "
                             "in its checkpoints/)")
        explicit = load_tokenizer(tokenizer) if tokenizer else None
        model, found = _load_checkpoint_model(checkpoint, explicit)
        return _finish_loading(model, found, path, device, dtype)
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"model path {directory} is not a directory; give a model, Hugging Face "
                        "or training checkpoint directory")
    explicit = load_tokenizer(tokenizer) if tokenizer else None
    has_config = (directory / "config.json").is_file()
    checkpoint = None if has_config else open_training_checkpoint(directory)
    if checkpoint is not None:
        model, found = _load_checkpoint_model(checkpoint, explicit)
    elif (directory / "config.json").is_file():
        model = load_model(directory) if is_model_dir(directory) else load_hf(directory)
        found = explicit or _tokenizer_beside(directory)
    else:
        raise UserError(
            f"{directory} is not a model directory (no config.json), a training "
            "checkpoint (step-N with manifest.json) or a directory holding one"
        )
    if found is None:
        raise UserError(
            f"no tokenizer.json or tokenizer.model beside {directory}; pass --tokenizer PATH"
        )
    return _finish_loading(model, found, directory, device, dtype)


def _finish_loading(model, found, directory, device: str, dtype: torch.dtype | None):
    if found.vocab_size > model.config.vocab_size:
        raise UserError(
            f"tokenizer {found.path} has {found.vocab_size} ids but the model {directory} only "
            f"{model.config.vocab_size} (vocab_size): not the model's tokenizer"
        )
    if dtype is not None:
        model = model.to(dtype)
    return model.to(resolve_device(device)).eval(), found
