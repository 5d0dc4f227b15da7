"""Language-model losses in fp32: cross-entropy with an ignore index and PaLM's z-loss.

``cross_entropy_loss`` takes full logits. ``chunked_lm_loss`` fuses the output projection with
the loss and runs it a chunk of tokens at a time, so the [tokens, vocab] logits never exist in
full. Its gradients are computed during the forward pass (the loss is the last op of the graph,
so dL/dlogits is known there) and only scaled by the incoming gradient in backward: no logits
are recomputed, and backward costs nothing but that scale.

Shape legend: B batch, S sequence, N = B·S tokens, C tokens in a chunk, E hidden width,
V vocab_size, P padded vocab rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class LossOutput(NamedTuple):
    """``loss`` (ce_loss + z_loss, differentiable), its parts (detached) and the number of
    non-ignored target tokens (an int64 tensor, so no host sync is forced)."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    z_loss: torch.Tensor
    num_tokens: torch.Tensor


def cross_entropy_loss(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss_coef: float = 0.0,
) -> LossOutput:
    """Mean cross-entropy over non-ignored targets, computed in fp32, plus optional z-loss.

    z-loss = ``z_loss_coef`` · mean(log²Z) over the same tokens, Z = sum(exp(logits))
    (Chowdhery et al. 2022, PaLM §5 "Training Setup", coefficient 1e-4). With no counted token
    the loss is 0.
    """
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1]).float()
    targets_N = targets_BS.reshape(-1)
    valid_N = targets_N != ignore_index
    num_tokens = valid_N.sum()
    denominator = num_tokens.clamp(min=1).float()
    ce_sum = F.cross_entropy(logits_NV, targets_N, ignore_index=ignore_index, reduction="sum")
    ce_loss = ce_sum / denominator
    if z_loss_coef > 0:
        lse_N = torch.logsumexp(logits_NV, dim=-1)
        z_loss = z_loss_coef * (lse_N.square() * valid_N).sum() / denominator
    else:
        z_loss = torch.zeros((), device=logits_NV.device)
    loss = ce_loss + z_loss
    return LossOutput(loss, ce_loss.detach(), z_loss.detach(), num_tokens)


def _chunk_loss_and_grad(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    valid_C: torch.Tensor,
    denominator: torch.Tensor,
    z_loss_coef: float,
    needs_grad: bool,
):
    """Sums of cross-entropy and log²Z over the counted tokens of one chunk, and (when
    ``needs_grad``) dL/dlogits in ``logits_CV``'s dtype, for the mean loss over
    ``denominator`` tokens. ``targets_C`` must be valid indices (ignored ones replaced).

    One log-softmax kernel in (at least) fp32 gives log p; lse = logit_t − log p_t (any
    column would do; the target column is at hand). d/dlogits of lse − logit_t + c·lse² is
    softmax·(1 + 2c·lse) − onehot(t), each token weighted by its share of the mean.
    Written for both eager mode and inductor, which fuses it into one pass over the logits
    (``compiled_chunk_kernel``).
    """
    dtype = torch.promote_types(logits_CV.dtype, torch.float32)  # at least fp32
    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=dtype)
    logp_t_C = logp_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1)
    lse_C = logits_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1).to(dtype) - logp_t_C
    ce_sum = (-logp_t_C * valid_C).sum()
    z_sum = (lse_C.square() * valid_C).sum()
    if not needs_grad:
        return ce_sum, z_sum, None
    weight_C = valid_C.to(dtype) / denominator
    scale_C1 = (weight_C * (1 + 2 * z_loss_coef * lse_C)).unsqueeze(1)
    if torch.compiler.is_compiling():
        # A one-hot compare instead of scatter_add_: inductor then writes the gradient in the
        # logits' dtype in the same loop as the exp, instead of materialising it in fp32 for
        # the scatter and casting in a further pass (the kernel alone: 1.7× faster).
        classes_1V = torch.arange(logits_CV.shape[1], device=logits_CV.device).unsqueeze(0)
        onehot_CV = classes_1V == targets_C.unsqueeze(1)
        grad_CV = logp_CV.exp() * scale_C1 - torch.where(onehot_CV, weight_C.unsqueeze(1), 0.0)
        return ce_sum, z_sum, grad_CV.to(logits_CV.dtype)
    grad_CV = logp_CV.exp_().mul_(scale_C1)  # eager: in place, and a scatter of C elements
    grad_CV.scatter_add_(1, targets_C.unsqueeze(1), -weight_C.unsqueeze(1))
    return ce_sum, z_sum, grad_CV.to(logits_CV.dtype)


_COMPILED_KERNEL = None


def compiled_chunk_kernel():
    """``_chunk_loss_and_grad`` through ``torch.compile`` (built once, on first use).

    Measured on 2 CPU cores, bf16 logits of 1,024 tokens × 50,304 classes, alternating runs:
    107 ms against 259 ms eager (the eager kernel chain reads and writes fp32 [C, V] tensors
    several times; inductor reads the bf16 logits in two row loops and writes the gradient in
    a third).
    """
    global _COMPILED_KERNEL
    if _COMPILED_KERNEL is None:
        _COMPILED_KERNEL = torch.compile(_chunk_loss_and_grad, dynamic=False)
    return _COMPILED_KERNEL


def chunked_lm_loss(
    hidden_BSE: torch.Tensor,
    output_weight_PE: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    vocab_size: int,
    chunk_size: int,
    ignore_index: int = -100,
    z_loss_coef: float = 0.0,
    output_bias_P: torch.Tensor | None = None,
    compiled: bool = False,
) -> LossOutput:
    """Output projection + ``cross_entropy_loss``, ``chunk_size`` tokens at a time.

    ``compiled`` runs the per-chunk softmax / loss / gradient through ``torch.compile``
    (``compiled_chunk_kernel``); the projections are matmuls either way.

    Equals ``cross_entropy_loss(F.linear(hidden, weight, bias)[..., :vocab_size], targets)`` in
    value and gradients (hidden, weight, bias) but peaks at [chunk_size, P] logits. Rows of
    ``output_weight_PE`` at or beyond ``vocab_size`` (vocab padding) are never used.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if not 0 < vocab_size <= output_weight_PE.shape[0]:
        raise ValueError(
            f"vocab_size must be in [1, {output_weight_PE.shape[0]}] (rows of the output "
            f"weight), got {vocab_size}"
        )
    weight_VE = output_weight_PE[:vocab_size]
    bias_V = output_bias_P[:vocab_size] if output_bias_P is not None else None
    hidden_NE = hidden_BSE.reshape(-1, hidden_BSE.shape[-1])
    targets_N = targets_BS.reshape(-1)
    needs_grad = torch.is_grad_enabled() and (
        hidden_NE.requires_grad
        or weight_VE.requires_grad
        or (bias_V is not None and bias_V.requires_grad)
    )
    kernel = compiled_chunk_kernel() if compiled else _chunk_loss_and_grad
    loss, ce_loss, z_loss, num_tokens = _ChunkedLMLoss.apply(
        hidden_NE, weight_VE, bias_V, targets_N, chunk_size, ignore_index, z_loss_coef, needs_grad,
        kernel,
    )
    return LossOutput(loss, ce_loss.detach(), z_loss.detach(), num_tokens)


class _ChunkedLMLoss(torch.autograd.Function):
    """Fused projection + loss whose forward also produces the input gradients."""

    @staticmethod
    def forward(
        ctx,
        hidden_NE,
        weight_VE,
        bias_V,
        targets_N,
        chunk_size,
        ignore_index,
        z_loss_coef,
        needs_grad,
        kernel,
    ):
        valid_N = targets_N != ignore_index
        num_tokens = valid_N.sum()
        denominator = num_tokens.clamp(min=1).float()
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden_NE.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=hidden_NE.device)
        grad_hidden_NE = torch.empty_like(hidden_NE) if needs_grad else None
        accumulate = torch.promote_types(weight_VE.dtype, torch.float32)
        grad_weight_VE = torch.zeros_like(weight_VE, dtype=accumulate) if needs_grad else None
        grad_bias_V = (
            torch.zeros(weight_VE.shape[0], dtype=accumulate, device=hidden_NE.device)
            if needs_grad and bias_V is not None
            else None
        )
        # The matmuls run in one compute dtype: the autocast dtype when autocast is on (bf16
        # on CPU/CUDA), else the hidden states' dtype. Autocast itself is switched off here:
        # it would re-cast the (non-leaf, so uncached) weight for every chunk and every
        # matmul, and it never applies to the in-place addmm_, which would then run the
        # weight-gradient matmul in fp32 — a third of this layer's FLOPs.
        device_type = hidden_NE.device.type
        compute = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else hidden_NE.dtype
        )
        with torch.autocast(device_type, enabled=False):
            w_VE = weight_VE.to(compute)
            b_V = bias_V.to(compute) if bias_V is not None else None
            for start in range(0, hidden_NE.shape[0], chunk_size):
                h_CE = hidden_NE[start : start + chunk_size].to(compute)
                t_C = targets_N[start : start + chunk_size]
                v_C = valid_N[start : start + chunk_size]
                logits_CV = F.linear(h_CE, w_VE, b_V)
                safe_t_C = torch.where(v_C, t_C, torch.zeros_like(t_C))
                ce_C, z_C, grad_logits_CV = kernel(
                    logits_CV, safe_t_C, v_C, denominator, z_loss_coef, needs_grad
                )
                ce_sum += ce_C
                z_sum += z_C
                if not needs_grad:
                    continue
                grad_hidden_NE[start : start + chunk_size] = grad_logits_CV @ w_VE
                if compute == accumulate:
                    grad_weight_VE.addmm_(grad_logits_CV.t(), h_CE)
                else:  # low-precision matmul, fp32 accumulation across chunks
                    grad_weight_VE.add_(grad_logits_CV.t() @ h_CE)
                if grad_bias_V is not None:
                    grad_bias_V += grad_logits_CV.to(accumulate).sum(0)
        ce_loss = ce_sum / denominator
        z_loss = z_loss_coef * z_sum / denominator
        if needs_grad:
            ctx.save_for_backward(grad_hidden_NE, grad_weight_VE, grad_bias_V)
            ctx.weight_dtype = weight_VE.dtype
        ce_out, z_out = ce_loss.clone(), z_loss.clone()
        ctx.mark_non_differentiable(ce_out, z_out, num_tokens)
        return ce_loss + z_loss, ce_out, z_out, num_tokens

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z, _grad_num):
        grad_hidden_NE, grad_weight_VE, grad_bias_V = ctx.saved_tensors
        grad_hidden = grad_hidden_NE * grad_loss.to(grad_hidden_NE.dtype)
        grad_weight = (grad_weight_VE * grad_loss).to(ctx.weight_dtype)
        grad_bias = None
        if grad_bias_V is not None:
            grad_bias = (grad_bias_V * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None
