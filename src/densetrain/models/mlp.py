"""Feed-forward block: GELU (exact or tanh), ReLU, or SwiGLU (Shazeer 2020).

Shape legend: B batch, S sequence, D dim, F ffn_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from densetrain.models.config import ModelConfig
from densetrain.models.fused import swiglu
from densetrain.models.linear import Linear

_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's): ``F.gelu(x, approximate="tanh")``.

    Inside a compiled CPU region it is written as x·σ(2·√(2/π)·(x + 0.044715·x³)), the same
    function (½(1 + tanh z) = σ(2z)) computed in fp32: inductor's vectorised CPU tanh is slow,
    its sigmoid is not — on 2 AMD EPYC Zen 5 cores, bf16 [2,048 × 1,536], forward + backward
    2.4 against 5.0 ms, which is 2% of the GPT-2-shaped training step (benchmarks/RESULTS.md).
    Eager, and on GPUs, ATen's own kernel stays.
    """
    if x.device.type != "cpu" or not torch.compiler.is_compiling():
        return F.gelu(x, approximate="tanh")
    x_f = x.float()
    return (x_f * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x_f + 0.044715 * x_f * x_f * x_f))).to(
        x.dtype)


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
            hidden_BSF = swiglu(self.w_gate(x_BSD), up_BSF)
        elif self.activation == "gelu":
            hidden_BSF = F.gelu(up_BSF)
        elif self.activation == "gelu_tanh":
            hidden_BSF = gelu_tanh(up_BSF)
        elif self.activation == "relu":
            hidden_BSF = F.relu(up_BSF)
        else:
            raise ValueError(
                "activation must be one of ['gelu', 'gelu_tanh', 'relu', 'swiglu'], "
                f"got {self.activation!r}"
            )
        return self.w_down(hidden_BSF)
