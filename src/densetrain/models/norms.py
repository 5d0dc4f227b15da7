"""Normalisation layers: LayerNorm (with or without bias) and RMSNorm.

Both are PyTorch's own modules (RMSNorm's forward is one operator that keeps for backward only
its input and ``rstd``: `densetrain.models.fused`), so the parameter names are ``weight`` (and
``bias`` for LayerNorm with a bias), as the parameter-name table in models/transformer.py
expects.
"""

from __future__ import annotations

from torch import nn

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.fused import RMSNorm


def build_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """Return the residual-stream norm selected by ``config.norm_type`` over ``dim`` features.

    ``layernorm`` is ``nn.LayerNorm`` (bias when ``config.norm_bias``); ``rmsnorm`` is
    ``nn.RMSNorm`` (Zhang & Sennrich 2019), which never has a bias, run as one operator that
    keeps only its input and ``rstd`` for backward (`densetrain.models.fused`).
    """
    width = config.dim if dim is None else dim
    if config.norm_type == "layernorm":
        return nn.LayerNorm(width, eps=config.norm_eps, bias=config.norm_bias)
    if config.norm_type == "rmsnorm":
        return RMSNorm(width, eps=config.norm_eps)
    raise UserError(f"norm_type must be one of ['layernorm', 'rmsnorm'], got {config.norm_type!r}")


def build_head_norm(config: ModelConfig) -> nn.Module:
    """RMSNorm over ``head_dim`` for queries and keys (Qwen3 QK-norm)."""
    return RMSNorm(config.head_dim, eps=config.norm_eps)
