"""``torch.compile`` per transformer block (regional compilation: one graph reused by every
block, so compile time does not grow with depth), applied after activation checkpointing and
before FSDP as torchtitan orders them."""

from __future__ import annotations

import torch
from torch import nn

from densetrain.errors import UserError


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each block of ``model.layers`` in place and return ``model``; a model with a
    chunked loss (``compile_loss_kernel``) also gets its per-chunk loss kernel compiled."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=False)
    if hasattr(model, "compile_loss_kernel"):
        model.compile_loss_kernel = True
    return model


def check_cpu_compiler() -> None:
    """Raise ``UserError`` naming ``training.compile`` when torch.compile's CPU backend
    (inductor, which generates and builds C++) finds no working C++ compiler. Checked before
    the model is built: otherwise the run fails at its first step with an ``InductorError``.

    Asks inductor itself (``get_cpp_compiler``, its own search over ``CXX`` / ``g++``), so the
    answer is the one the first compile would get; where that function has moved (another torch
    release) the check is skipped and the first compile reports the problem itself.
    """
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:
        return
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        cxx = inductor_config.cpp.cxx
        tried = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]
        raise UserError(
            "training.compile=true on CPU needs a C++ compiler for torch.compile (inductor "
            f"builds its kernels in C++), and none works here (tried "
            f"{', '.join(tried) or 'none'}: $CXX, else g++); install g++ or clang++, set CXX "
            "to one, or set --training.compile=false"
        ) from None
