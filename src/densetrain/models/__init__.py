"""densetrain.models: the configurable dense decoder, its losses and its sizing formulas.

The configs, presets and sizing formulas are plain Python and import at once; the torch parts
(``Transformer``, the losses) import on first use (PEP 562 module ``__getattr__``), so that
``densetrain model-info``, ``presets`` and the planner answer without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from densetrain.lazy import lazy_exports
from densetrain.models.config import ModelConfig, RopeScaling
from densetrain.models.presets import get_preset, list_presets
from densetrain.models.sizing import (
    ParamCounts,
    flops_per_token_chinchilla,
    flops_per_token_palm,
    kv_cache_bytes_per_token,
    param_counts,
)

if TYPE_CHECKING:
    from densetrain.models.loss import LossOutput, chunked_lm_loss, cross_entropy_loss
    from densetrain.models.transformer import Transformer

_TORCH_EXPORTS = {
    "LossOutput": "densetrain.models.loss",
    "chunked_lm_loss": "densetrain.models.loss",
    "cross_entropy_loss": "densetrain.models.loss",
    "Transformer": "densetrain.models.transformer",
}

__all__ = [
    "LossOutput",
    "ModelConfig",
    "ParamCounts",
    "RopeScaling",
    "Transformer",
    "chunked_lm_loss",
    "cross_entropy_loss",
    "flops_per_token_chinchilla",
    "flops_per_token_palm",
    "get_preset",
    "kv_cache_bytes_per_token",
    "list_presets",
    "param_counts",
]


__getattr__ = lazy_exports(__name__, _TORCH_EXPORTS, globals())
