"""densetrain's own model checkpoint format, written by ``densetrain convert --from-hf``.

A directory with two files:

- ``config.json``: ``ModelConfig.to_dict()`` (every field, ``rope_scaling`` as a dict or null,
  provenance in ``extra``), read back with ``ModelConfig.from_dict``;
- ``model.safetensors``: the ``Transformer`` state dict under the parameter names of
  docs/architecture.md (padded vocabulary rows included; tied models store only
  ``tok_embeddings.weight``). Above ``max_shard_bytes`` it is sharded as Hugging Face does
  (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``).

Training checkpoints (optimizer, data loader, ...) are a different, DCP-based format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from densetrain.models.config import ModelConfig
from densetrain.models.hf.files import (
    DEFAULT_MAX_SHARD_BYTES,
    checkpoint_files,
    read_json,
    read_tensors,
    write_directory_atomically,
    write_json,
    write_safetensors,
)
from densetrain.models.hf.interop import build_model
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


def load_model(path: str | Path, *, dtype: torch.dtype | None = None) -> Transformer:
    """Read a densetrain model directory; ``ValueError`` names a bad config or tensor."""
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} has no config.json; expected a densetrain model directory")
    data = read_json(config_path)
    if "model_type" in data:
        raise ValueError(
            f"{config_path} is a Hugging Face config (model_type={data['model_type']!r}); "
            "use load_hf or `densetrain convert --from-hf`"
        )
    cfg = ModelConfig.from_dict(data)
    files = checkpoint_files(directory)
    state = read_tensors(files, set(files))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    try:
        return build_model(cfg, state)
    except RuntimeError as error:
        raise ValueError(f"{directory}: tensors do not match config.json: {error}") from error


def is_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds a densetrain (not Hugging Face) ``config.json``."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    return "model_type" not in read_json(config_path)
