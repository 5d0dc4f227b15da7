"""RMSNorm and the SwiGLU product as single operators that keep for backward only what it reads.

Written here because PyTorch's own versions keep more: ``torch.rms_norm`` is a composite on
the CPU (and on CUDA whenever the input and weight dtypes differ, as under autocast over fp32
weights), so autograd keeps the fp32 upcast of the input and the fp32 normalised product beside
it (4 bytes twice per element for a bf16 input of 2); ``F.silu(G) * U`` keeps the SiLU output
beside G and U. Here:

- ``densetrain::rms_norm(x, weight, eps)`` keeps ``x`` in its own dtype and ``rstd`` [..., 1]
  in the math type (fp32 for 16-bit inputs); backward recomputes the upcast and the
  normalised input;
- ``densetrain::swiglu(G, U)`` = silu(G)·U keeps G and U; backward recomputes silu(G).

Each is bit-identical to the composite it replaces, forward and backward: the forward runs the
same ATen ops in the same order, and the backward is the chain of ATen derivative formulas that
autograd applies to that composite (tests/unit/models/test_fused.py compares bits). Being one
operator each, activation checkpointing's policy (`densetrain.parallel.checkpointing`) can keep
or recompute a norm's output or the SwiGLU product as a whole. Under ``torch.compile`` the
modules keep the composite: inductor fuses it and its partitioner chooses what to save. Tensor
parallel registers how DTensor shards them (`densetrain.parallel.tensor`).

Shape legend: N leading (batch, sequence) dimensions, D the normalised features, F ffn_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _upcast(x: torch.Tensor) -> torch.Tensor:
    # the operator's math type: fp32 for 16-bit inputs, the input's own dtype otherwise
    return x.float() if x.element_size() < 4 else x


def _rms_parts(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x_f = _upcast(x)
    rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    return x_f, rstd


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The composite: ``(x·rstd·weight)`` in fp32, returned in ``x``'s dtype (what
    ``torch.rms_norm`` computes, bit for bit)."""
    x_f, rstd = _rms_parts(x, eps)
    y = x_f * rstd
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


@torch.library.custom_op("densetrain::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    x_f, rstd = _rms_parts(x, eps)
    y = x_f * rstd
    if weight is not None:
        y = y * weight
    return y.to(x.dtype), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    rstd_dtype = torch.float32 if x.element_size() < 4 else x.dtype
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], 1), dtype=rstd_dtype)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_weight = weight is not None


def _rms_norm_backward(ctx, grad_y, grad_rstd):
    # autograd's derivative formulas for the composite above, in its order
    x, weight, rstd = ctx.saved_tensors
    x_f = _upcast(x)
    t = x_f * rstd
    grad_f = grad_y.to(x_f.dtype)
    grad_weight = None
    if ctx.has_weight:
        leading = tuple(range(grad_f.dim() - 1))
        grad_weight = (grad_f * t).sum(leading).to(weight.dtype)
        grad_t = grad_f * weight
    else:
        grad_t = grad_f
    grad_x_direct = grad_t * rstd
    grad_rstd_total = (grad_t * x_f).sum(-1, keepdim=True)
    grad_mean = -0.5 * grad_rstd_total * rstd.pow(3)
    grad_sq = grad_mean.expand_as(x_f) / x_f.shape[-1]
    grad_x_sq = grad_sq * (2.0 * x_f.pow(1.0))
    grad_x = (grad_x_direct + grad_x_sq).to(x.dtype)
    return grad_x, grad_weight, None


_rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension (Zhang & Sennrich 2019), in ``x``'s dtype."""
    if torch.compiler.is_compiling():
        return rms_norm_reference(x, weight, eps)
    return _rms_norm(x, weight, eps)[0]


@torch.library.custom_op("densetrain::swiglu", mutates_args=())
def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@_swiglu.register_fake
def _(gate, up):
    return torch.empty_like(torch.broadcast_tensors(gate, up)[0],
                            dtype=torch.promote_types(gate.dtype, up.dtype))


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    grad_up = grad * F.silu(gate)
    grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
    return grad_gate, grad_up


_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate_NF: torch.Tensor, up_NF: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up (Shazeer 2020), keeping only ``gate`` and ``up`` for backward."""
    if torch.compiler.is_compiling() or gate_NF.dtype != up_NF.dtype:
        return F.silu(gate_NF) * up_NF
    return _swiglu(gate_NF, up_NF)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters, same values) through `rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension; returns ``x``'s dtype."""
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)


FUSED_OPS = (torch.ops.densetrain.rms_norm.default, torch.ops.densetrain.swiglu.default)
"""The operators defined here (activation checkpointing's policy names them)."""
