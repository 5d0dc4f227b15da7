"""Linear layers whose fp32 CPU matmuls with a short reduction go to oneDNN instead of MKL.

On x86 CPUs PyTorch runs every fp32 ``F.linear`` through MKL's sgemm. For the shapes of a
transformer's forward (a reduction over the model width, a few hundred wide) MKL reaches less of
the machine than oneDNN, which PyTorch also ships (``torch.ops.mkldnn._linear_pointwise``, the
op inductor lowers CPU linears to) but only calls for low-precision or packed weights. Measured
on 2 AMD EPYC cores (AVX2), [2048 × K] @ [K × 1536], both libraries alternating:
oneDNN/MKL speed 1.08 (K 128-256), 1.17 (384), 1.30 (512), 1.20 (768), 1.03 (1024); MKL is
ahead from K ≈ 1500 on (0.93 at K 50,304). So a matmul goes to oneDNN when its reduction is
at most ``ONEDNN_MAX_REDUCTION``; the choice depends on shapes only, so it is the same on every
rank and after every restart (resume stays bit-exact).

Only plain fp32 CPU tensors outside autocast and outside ``torch.compile`` take this path:
DTensors (tensor parallel), CUDA, bf16 / autocast (already oneDNN in PyTorch), compiled
regions (inductor picks its own kernels) and fully checkpointed blocks (`aten_matmuls`) run
``F.linear`` unchanged. Written here because
PyTorch offers no switch for it: its fp32 oneDNN matmul setting computes in bf16 or tf32.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

ONEDNN_MAX_REDUCTION = 768
"""Largest reduction (inner) dimension sent to oneDNN; larger ones stay with MKL."""

ONEDNN_LINEAR_OP = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available() else None
)
"""oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``), or None in a build without it."""

_LOCAL = threading.local()


@contextlib.contextmanager
def aten_matmuls() -> Iterator[None]:
    """Within this context (on this thread) every `linear` runs ``F.linear``.

    Full activation checkpointing enters it for the forward and the recompute of a block:
    torch's non-reentrant checkpoint stops recomputing once the last tensor that backward needs
    is rebuilt, which an aten matmul saves before it runs but a custom autograd function only
    after, so a block's last matmul would be recomputed for nothing.
    """
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def _register_flop_formula() -> None:
    """Count ``_linear_pointwise`` in ``torch.utils.flop_counter`` (torch knows only the aten
    matmuls), so FLOP counts of a model do not depend on which library ran its matmuls."""
    from torch.utils import flop_counter

    if ONEDNN_LINEAR_OP is None or ONEDNN_LINEAR_OP in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(ONEDNN_LINEAR_OP)
    def _linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        tokens = 1
        for size in x_shape[:-1]:
            tokens *= size
        return 2 * tokens * x_shape[-1] * w_shape[0]


_register_flop_formula()


def _plain_cpu_fp32(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu"
                      and t.dtype == torch.float32)
        for t in tensors
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear(x, weight, bias)`` runs its forward matmul on oneDNN."""
    return (
        weight.shape[1] <= ONEDNN_MAX_REDUCTION
        and _plain_cpu_fp32(x, weight, bias)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not getattr(_LOCAL, "depth", 0)
        and ONEDNN_LINEAR_OP is not None
    )


def _onednn_linear(x_2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    # oneDNN reorders a non-contiguous weight on every call (slower than copying it once).
    return ONEDNN_LINEAR_OP(x_2d.contiguous(), weight.contiguous(), bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """y = x Wᵀ + b with the forward (reduction over in-features) on oneDNN, the input
    gradient (reduction over out-features) on oneDNN when that is short too, and the weight
    gradient (reduction over tokens, long) on MKL."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x_2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_2d, weight)
        ctx.x_shape = x.shape
        return _onednn_linear(x_2d, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable  # the oneDNN op has no derivative: a second backward says so
    def backward(ctx, grad_out):
        x_2d, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if weight.shape[0] <= ONEDNN_MAX_REDUCTION:
                grad_x = _onednn_linear(grad_2d, weight.t(), None)
            else:
                grad_x = grad_2d @ weight
            grad_x = grad_x.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = grad_2d.t() @ x_2d
        if ctx.needs_input_grad[2]:  # False when there is no bias
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` (differentiable), on oneDNN where `uses_onednn` says so."""
    if uses_onednn(x, weight, bias):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict keys and parallel plans) whose plain fp32 CPU
    forward and backward take the faster library per matmul (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
