"""densetrain.models: the configurable dense decoder, its losses and its sizing formulas."""

from densetrain.models.config import ModelConfig, RopeScaling
from densetrain.models.loss import LossOutput, chunked_lm_loss, cross_entropy_loss
from densetrain.models.sizing import (
    ParamCounts,
    flops_per_token_chinchilla,
    flops_per_token_palm,
    kv_cache_bytes_per_token,
    param_counts,
)
from densetrain.models.transformer import Transformer

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
    "kv_cache_bytes_per_token",
    "param_counts",
]

# --- presets (get_preset, list_presets) are exported below this line ---

from densetrain.models.presets import get_preset, list_presets  # noqa: E402

__all__ += ["get_preset", "list_presets"]
