"""Normalisation layers: LayerNorm (with or without bias) and RMSNorm.

Both are thin wrappers over PyTorch's own modules so that the fused kernels are used and the
parameter names are ``weight`` (and ``bias`` for LayerNorm with a bias), as the parameter-name
table in models/transformer.py expects.
"""

from __future__ import annotations

from torch import nn

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig


def build_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """Return the residual-stream norm selected by ``config.norm_type`` over ``dim`` features.

    ``layernorm`` is ``nn.LayerNorm`` (bias when ``config.norm_bias``); ``rmsnorm`` is
    ``nn.RMSNorm`` (Zhang & Sennrich 2019), which never has a bias.
    """
    width = config.dim if dim is None else dim
    if config.norm_type == "layernorm":
        return nn.LayerNorm(width, eps=config.norm_eps, bias=config.norm_bias)
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    raise UserError(f"norm_type must be one of ['layernorm', 'rmsnorm'], got {config.norm_type!r}")


def build_head_norm(config: ModelConfig) -> nn.Module:
    """RMSNorm over ``head_dim`` for queries and keys (Qwen3 QK-norm)."""
    return nn.RMSNorm(config.head_dim, eps=config.norm_eps)
