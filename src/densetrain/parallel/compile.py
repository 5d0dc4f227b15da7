"""``torch.compile`` per transformer block (regional compilation: one graph reused by every
block, so compile time does not grow with depth), applied after activation checkpointing and
before FSDP as torchtitan orders them."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each block of ``model.layers`` in place and return ``model``; a model with a
    chunked loss (``compile_loss_kernel``) also gets its per-chunk loss kernel compiled."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=False)
    if hasattr(model, "compile_loss_kernel"):
        model.compile_loss_kernel = True
    return model
