"""Feed-forward block: GELU (exact or tanh), ReLU, or SwiGLU (Shazeer 2020).

Shape legend: B batch, S sequence, D dim, F ffn_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from densetrain.models.config import ModelConfig
from densetrain.models.linear import Linear


class MLP(nn.Module):
    """``w_down(act(w_up(x)))``, or ``w_down(silu(w_gate(x)) * w_up(x))`` for SwiGLU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.activation
        bias = config.mlp_bias
        self.w_up = Linear(config.dim, config.ffn_dim, bias=bias)
        self.w_gate = (
            Linear(config.dim, config.ffn_dim, bias=bias)
            if config.activation == "swiglu"
            else None
        )
        self.w_down = Linear(config.ffn_dim, config.dim, bias=bias)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward block to ``x_BSD``; returns [B, S, D]."""
        up_BSF = self.w_up(x_BSD)
        if self.w_gate is not None:
            hidden_BSF = F.silu(self.w_gate(x_BSD)) * up_BSF
        elif self.activation == "gelu":
            hidden_BSF = F.gelu(up_BSF)
        elif self.activation == "gelu_tanh":
            hidden_BSF = F.gelu(up_BSF, approximate="tanh")
        elif self.activation == "relu":
            hidden_BSF = F.relu(up_BSF)
        else:
            raise ValueError(
                "activation must be one of ['gelu', 'gelu_tanh', 'relu', 'swiglu'], "
                f"got {self.activation!r}"
            )
        return self.w_down(hidden_BSF)
