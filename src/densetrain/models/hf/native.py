"""densetrain's own model checkpoint format, written by ``densetrain convert --from-hf``.

A directory with two files:

- ``config.json``: ``ModelConfig.to_dict()`` (every field, ``rope_scaling`` as a dict or null,
  provenance in ``extra``), read back with ``read_model_config`` (every key and type checked);
- ``model.safetensors``: the ``Transformer`` state dict under the parameter names of
  ``models/transformer.py`` (padded vocabulary rows included; tied models store only
  ``tok_embeddings.weight``). Above ``max_shard_bytes`` it is sharded as Hugging Face does
  (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``).

Training checkpoints (optimizer, data loader, ...) are a different, DCP-based format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.files import (
    DEFAULT_MAX_SHARD_BYTES,
    checkpoint_files,
    read_json,
    read_tensors,
    tensor_specs,
    weight_dtype,
    write_directory_atomically,
    write_json,
    write_safetensors,
)
from densetrain.models.hf.interop import build_model, check_tensors
from densetrain.models.hf.shapes import dt_param_shapes
from densetrain.models.transformer import Transformer


def save_model(
    model: Transformer,
    path: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Write ``model`` as a densetrain model directory (atomically)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    config = model.config.to_dict()

    def fill(directory: Path) -> None:
        write_safetensors(directory, state, max_shard_bytes)
        write_json(directory / "config.json", config)

    write_directory_atomically(Path(path), fill, overwrite=overwrite)


def read_model_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a densetrain model directory (or of its ``config.json``).

    Required keys, unknown keys, value types and ranges are checked (``ModelConfig.from_dict``);
    ``UserError`` names ``config.json`` and the field.
    """
    config_path = Path(path)
    if not config_path.is_file():
        config_path = config_path / "config.json"
        if not config_path.is_file():
            raise UserError(f"{path} has no config.json; expected a densetrain model directory")
    data = read_json(config_path)
    if "model_type" in data:
        raise UserError(
            f"{config_path} is a Hugging Face config (model_type={data['model_type']!r}); "
            "use load_hf or `densetrain convert --from-hf`"
        )
    return ModelConfig.from_dict(data, source=str(config_path))


def check_model_dir(path: str | Path) -> ModelConfig:
    """The checked ``ModelConfig`` of a densetrain model directory whose safetensors headers
    (tensor names, shapes, dtypes) match it; reads no tensor data. ``UserError`` otherwise."""
    return _checked(Path(path))[0]


def _checked(directory: Path) -> tuple[ModelConfig, dict[str, Path], torch.dtype]:
    """(config, tensor files, the dtype the weights load in), checked before any data is read:
    every tensor ``Transformer(config)`` has, of its shape, none more, all floating point."""
    cfg = read_model_config(directory)
    files = checkpoint_files(directory)
    specs = tensor_specs(files)
    check_tensors(directory, dt_param_shapes(cfg),
                  {name: (name, shape) for name, (shape, _) in specs.items()})
    dtype = weight_dtype({name: code for name, (_, code) in specs.items()}, directory)
    return cfg, files, dtype


def load_model(path: str | Path, *, dtype: torch.dtype | None = None) -> Transformer:
    """Read a densetrain model directory; ``ValueError`` names a bad config or tensor.

    Tensor names, shapes and dtypes are checked against ``config.json`` before any data is
    read. ``dtype`` casts the weights; None keeps the stored dtype (mixed floating dtypes are
    all loaded as the widest of them; see ``files.weight_dtype``).
    """
    directory = Path(path)
    cfg, files, stored_dtype = _checked(directory)
    state = {k: v.to(dtype or stored_dtype) for k, v in read_tensors(files, set(files)).items()}
    try:
        return build_model(cfg, state)
    except RuntimeError as error:
        raise UserError(f"{directory}: tensors do not match config.json: {error}") from error


def is_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds a densetrain (not Hugging Face) ``config.json``."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    return "model_type" not in read_json(config_path)
