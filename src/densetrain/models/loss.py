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

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from densetrain.models.linear import (
    cpu_has_amx,
    linear,
    matmul,
    matmul_uses_onednn,
    transposed_copy,
)


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


def _target_logit(logits_CV: torch.Tensor, targets_C: torch.Tensor):
    """The kernels' dtype (at least fp32) and each row's logit at its target, in it."""
    dtype = torch.promote_types(logits_CV.dtype, torch.float32)
    return dtype, logits_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1).to(dtype)


def _exact_softmax_and_lse(logits_CV: torch.Tensor, targets_C: torch.Tensor,
                           needs_grad: bool):
    """log Z and the target's logit of every row in (at least) fp32 and, when ``needs_grad``,
    softmax(logits) in the logits' dtype, for the gradient matmuls.

    An exact ``logsumexp``, then the probabilities exp(logit − log Z). Under inductor the max
    and the sum of exp are fused in the row loops and the probabilities written in one more
    loop, with no fp32 copy of low-precision logits in between; eager off the CPU it is a few
    kernels over one fp32 buffer (the logits themselves when they are fp32) and no host sync.
    """
    dtype, logit_t_C = _target_logit(logits_CV, targets_C)
    work_CV = logits_CV.to(dtype)  # fp32 logits themselves, else one fp32 copy
    lse_C = torch.logsumexp(work_CV, dim=-1)
    if not needs_grad:
        return lse_C, logit_t_C, None
    # exp(logit − log Z) written over the (fp32) work buffer: no further [C, V] temporaries
    probs_CV = work_CV.sub_(lse_C.unsqueeze(1)).exp_()
    return lse_C, logit_t_C, probs_CV.to(logits_CV.dtype)


def _is_fake(tensor: torch.Tensor) -> bool:
    """A fake tensor (shapes, no values: a dry run), which the CPU kernel's one-flag host sync
    cannot read; it takes the sync-free path every other device takes."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def _softmax_and_lse(logits_CV: torch.Tensor, targets_C: torch.Tensor, needs_grad: bool,
                     row_logits: Callable[[torch.Tensor], torch.Tensor]):
    """The eager kernel: `_exact_softmax_and_lse`'s results (probabilities in fp32 for
    low-precision logits: the caller casts).

    The softmax is written over fp32 logits (or over one fp32 copy of low-precision ones), so a
    chunk holds one [C, V] fp32 buffer instead of two (206 MB less at 1,024 × 50,304);
    ``row_logits(mask)`` rebuilds the logits of the rows that the boolean ``mask`` selects, for
    the exact log Z of an underflowing row.

    On the CPU, one softmax kernel is the only pass over the [C, V] logits (a row is read from
    memory once and worked in cache); log Z comes from the target column,
    lse = logit_t − log p_t. Where p_t underflows (logit_t more than ~87 below log Z, i.e. a
    loss beyond 87 nats) that row's log Z is recomputed exactly with ``logsumexp``, so the loss
    stays right in a divergence; the check reads one flag per chunk, a host sync, so other
    devices take `_exact_softmax_and_lse`. Without gradients ``logsumexp`` alone is the pass.

    Measured on 2 CPU cores, fp32 logits of 1,024 tokens × 50,304 classes: 45 ms against 102
    ms for log-softmax + exp + scale (three passes over the logits).
    """
    if logits_CV.device.type != "cpu" or not needs_grad or _is_fake(logits_CV):
        return _exact_softmax_and_lse(logits_CV, targets_C, needs_grad)
    dtype, logit_t_C = _target_logit(logits_CV, targets_C)
    work_CV = logits_CV.to(dtype)  # fp32 logits themselves, else one fp32 copy
    probs_CV = torch.softmax(work_CV, dim=-1, out=work_CV)
    p_t_C = probs_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1)
    lse_C = logit_t_C - torch.log(p_t_C)
    underflow_C = ~(p_t_C >= torch.finfo(dtype).tiny)  # also NaN rows: recomputed, stay NaN
    if bool(underflow_C.any()):  # their logits are overwritten: rebuilt for the exact log Z
        lse_C[underflow_C] = torch.logsumexp(row_logits(underflow_C).to(dtype), dim=-1)
    return lse_C, logit_t_C, probs_CV


def _exponentials_into_logits(logits_CV: torch.Tensor, targets_C: torch.Tensor,
                              needs_grad: bool):
    """Each row's max (``[C, 1]``), the target's logit and, when ``needs_grad``, Σ exp(logit −
    row max), all in fp32, with the unnormalised softmax exp(logit − row max) written over the
    (low-precision) logits; without ``needs_grad``, log Z in place of the max and None.

    One exponential per logit: the probabilities' normalisation is left to the row scale that
    the chunked loss applies to its gradient matmuls' [C, E] operands anyway, so no second
    pass computes exp(logit − log Z). Rounded once to the logits' dtype, as the probabilities
    would be; the sum adds the rounded values, so the written rows divided by it sum to 1.

    log Z = max + log Σ and the factor 1 / Σ are left to the caller: a [C] element-wise loop
    here would be vectorised across rows, which keeps inductor from running the max and the
    exponentials of a row in one loop over the rows (its outer-loop fusion needs the same
    row step in every fused loop), and each pass would then stream the whole chunk from memory.
    """
    dtype, logit_t_C = _target_logit(logits_CV, targets_C)
    work_CV = logits_CV.to(dtype)
    if not needs_grad:
        return torch.logsumexp(work_CV, dim=-1), logit_t_C, None
    max_C1 = work_CV.amax(dim=-1, keepdim=True)
    exp_CV = torch.exp(work_CV - max_C1).to(logits_CV.dtype)
    sum_C = exp_CV.to(dtype).sum(dim=-1)
    logits_CV.copy_(exp_CV)
    return max_C1, logit_t_C, sum_C


@functools.cache
def compiled_chunk_kernel():
    """The per-chunk kernel of low-precision logits through ``torch.compile`` (built once, on
    first use): `_exponentials_into_logits`, returning ``(lse, target logit, exponentials,
    row factor)``, where the exponentials are the logits' own buffer (``None`` and ``None``
    without ``needs_grad``); exponentials × row factor are the probabilities.

    Inductor runs one loop over the rows, and for each row the max, then the exponentials,
    written and summed (the row, 98 KB of bf16, still in cache for its second read), and writes
    them in place, so a chunk holds one [C, V] buffer (98 MB less at 1,024 × 50,304 in bf16
    than an fp32 softmax) and computes one exponential per logit. [1,024 × 50,304] bf16: 2 AMD
    EPYC Zen 5 cores, 13 ms against 21 ms for the normalised probabilities (exp(logit − log Z),
    a second exponential); 2 cores of an AMX Xeon, 18-20 ms against 35-36 ms with log Z formed
    inside (whose row-vectorised loop split the max and the exponentials into two passes over
    the whole chunk). fp32 logits take the
    eager softmax, which writes its probabilities in place with one exponential per logit as
    well and needs no compilation (same host, [1,024 × 50,304] fp32: 14.8 ms eager, 14.4 ms
    for this kernel compiled).
    """
    compiled = torch.compile(_exponentials_into_logits, dynamic=False)

    def kernel(logits_CV: torch.Tensor, targets_C: torch.Tensor, needs_grad: bool):
        first_C, logit_t_C, sum_C = compiled(logits_CV, targets_C, needs_grad)
        if not needs_grad:  # first_C: log Z
            return first_C, logit_t_C, None, None
        lse_C = first_C.squeeze(1) + torch.log(sum_C)
        return lse_C, logit_t_C, logits_CV, torch.reciprocal(sum_C)

    return kernel


WGRAD_ROWS = 4096
"""Vocab rows per low-precision weight-gradient matmul of `chunked_lm_loss` (2 CPU cores, bf16,
[1,024 tokens × 50,304] probabilities: 113 ms for two chunks against 115 ms in one matmul)."""


TRANSPOSED_LOW_PRECISION_HEAD: bool = cpu_has_amx()
"""Whether bf16 CPU output heads of `chunked_lm_loss` work from one contiguous [E, V] copy of
the weight instead of the [V, E] one (True on CPUs with AMX).

oneDNN's AMX matmuls are fast only when neither operand is a transposed view. On 2 cores of an
AMX Xeon, bf16, 1,024 tokens × 50,304 classes × width 384: the logits h @ wᵀ 28 ms from the
[V, E] weight against 14 ms from a contiguous [E, V] one; the input gradient p @ w 42-46 ms
in one product against 26-27 ms as a sum of products over blocks of `DX_BLOCK` vocab rows
(either weight layout). The transposing copy costs 18.5 ms a step (against 5.9 ms for the
plain cast), so a step of two chunks saves about 50 ms. fp16, which AMX-BF16 does not run
(0.31 TFLOP/s here either way), and CPUs without AMX keep the [V, E]
layout and one input-gradient product, as measured there. Runs that compile make the copy
with inductor (`compiled_transposed_cast`)."""

DX_BLOCK = 2048
"""Vocab rows per partial product of the input gradient p @ w on the transposed head (AMX:
26 ms at 2,048, 28 ms at 1,024, 46 ms from 3,072 rows on, as in one product)."""

TRANSPOSE_ROWS = 1024
"""Weight rows per block of the transposing cast (a block's source and target stay in cache:
18.5 ms for a 50,304 × 384 fp32 weight into bf16, against 46 ms in one copy)."""


def _transposed_cast(weight_VE: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [E, V] copy of ``weight_VE`` in ``dtype``, written a block of rows at a
    time."""
    rows, width = weight_VE.shape
    weight_EV = weight_VE.new_empty((width, rows), dtype=dtype)
    for row in range(0, rows, TRANSPOSE_ROWS):
        weight_EV[:, row : row + TRANSPOSE_ROWS].copy_(weight_VE[row : row + TRANSPOSE_ROWS].t())
    return weight_EV


@functools.cache
def compiled_transposed_cast():
    """`_transposed_cast` through ``torch.compile`` (built once, on first use), for runs that
    compile: inductor's tiled transpose, 12 ms against 18.5 ms for the blocked copies (50,304
    × 384 fp32 into bf16, 2 cores of an AMX Xeon)."""
    return torch.compile(lambda weight_VE, dtype: weight_VE.t().to(dtype).contiguous(),
                         dynamic=False)


def _blocked_input_grad(p_CV: torch.Tensor, w_EV: torch.Tensor,
                        accumulate: torch.dtype) -> torch.Tensor:
    """p @ wᵀ of [C, V] probabilities and an [E, V] weight, summed in ``accumulate`` over
    products of `DX_BLOCK` vocab rows."""
    rows_CE = None
    for row in range(0, p_CV.shape[1], DX_BLOCK):
        part_CE = p_CV[:, row : row + DX_BLOCK] @ w_EV[:, row : row + DX_BLOCK].t()
        rows_CE = part_CE.to(accumulate) if rows_CE is None else rows_CE.add_(part_CE)
    return rows_CE


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

    ``compiled`` runs the per-chunk softmax of low-precision (bf16 / fp16) logits through
    ``torch.compile`` (``compiled_chunk_kernel``); fp32 logits always take the eager softmax,
    the faster one for them; the projections are matmuls either way.

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
    hidden_NE = hidden_BSE.reshape(-1, hidden_BSE.shape[-1])
    targets_N = targets_BS.reshape(-1)
    needs_grad = torch.is_grad_enabled() and (
        hidden_NE.requires_grad
        or output_weight_PE.requires_grad
        or (output_bias_P is not None and output_bias_P.requires_grad)
    )
    # The whole [P, E] weight goes in, not its [:vocab_size] rows: a slice would add autograd's
    # slice backward, a zero-filled [P, E] gradient and a copy into it (for a tied 50k × 384
    # embedding, 25 ms of a 3.5 s CPU step); the function writes the padding rows' zeros.
    loss, ce_loss, z_loss, num_tokens = _ChunkedLMLoss.apply(
        hidden_NE, output_weight_PE, output_bias_P, targets_N, vocab_size, chunk_size,
        ignore_index, z_loss_coef, needs_grad, compiled,
    )
    return LossOutput(loss, ce_loss.detach(), z_loss.detach(), num_tokens)


def _unit_seed_on_cpu(grad_loss: torch.Tensor) -> bool:
    """Whether the backward's seed is a CPU value of exactly 1 (a plain ``loss.backward()``):
    the saved gradients are then returned as they are, saving a pass over the head's weight
    gradient (77 MB at 50,304 × 384 in fp32; 3 ms of a 0.47 s bf16 step on 2 cores). Reading
    the value costs nothing on the CPU; elsewhere it would be a host sync, so other devices
    always multiply, as does a fake (dry-run) seed."""
    return grad_loss.device.type == "cpu" and not _is_fake(grad_loss) and bool(grad_loss == 1)


def scaled_head_grads(ctx, grad_loss: torch.Tensor):
    """The (hidden, weight, bias) gradients a fused loss head saved in forward, times the
    backward's seed ``grad_loss``; the weight's and bias's in the weight's dtype.

    Scaled in place: the saved gradients are used once, and a [P, E] copy of the output
    weight's would raise the peak (77 MB for a 50k × 384 fp32 head). A second backward
    through the graph (retain_graph) fails loudly on their version counters."""
    grad_hidden_NE, grad_weight_PE, grad_bias_P = ctx.saved_tensors
    unscaled = _unit_seed_on_cpu(grad_loss)

    def scaled(grad: torch.Tensor) -> torch.Tensor:
        return grad if unscaled else grad.mul_(grad_loss.to(grad.dtype))

    grad_bias = None if grad_bias_P is None else scaled(grad_bias_P).to(ctx.weight_dtype)
    return scaled(grad_hidden_NE), scaled(grad_weight_PE).to(ctx.weight_dtype), grad_bias


class _ChunkedLMLoss(torch.autograd.Function):
    """Fused projection + loss whose forward also produces the input gradients."""

    @staticmethod
    def forward(
        ctx,
        hidden_NE,
        weight_PE,
        bias_P,
        targets_N,
        vocab_size,
        chunk_size,
        ignore_index,
        z_loss_coef,
        needs_grad,
        compiled,
    ):
        weight_VE = weight_PE[:vocab_size]
        bias_V = bias_P[:vocab_size] if bias_P is not None else None
        valid_N = targets_N != ignore_index
        num_tokens = valid_N.sum()
        denominator = num_tokens.clamp(min=1).float()
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden_NE.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=hidden_NE.device)
        grad_hidden_NE = torch.empty_like(hidden_NE) if needs_grad else None
        accumulate = torch.promote_types(weight_PE.dtype, torch.float32)
        grad_weight_PE = grad_bias_P = grad_weight_VE = grad_bias_V = None

        def new_weight_grad():
            # The vocab rows are written whole by the first chunk's matmul or the final copy
            # (no zero fill, no read of them there); padding rows get zeros.
            new_grad = torch.empty_like if hidden_NE.shape[0] else torch.zeros_like
            grad_PE = new_grad(weight_PE, dtype=accumulate)
            grad_PE[vocab_size:].zero_()
            return grad_PE, grad_PE[:vocab_size]

        if needs_grad and bias_P is not None:
            grad_bias_P = torch.zeros_like(bias_P, dtype=accumulate)
            grad_bias_V = grad_bias_P[:vocab_size]
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
            b_V = bias_V.to(compute) if bias_V is not None else None
            low_precision = torch.finfo(compute).bits < 32
            compiled_kernel = compiled_chunk_kernel() if compiled and low_precision else None
            # bf16 on an AMX CPU: every product from one contiguous [E, V] copy of the weight
            # (`TRANSPOSED_LOW_PRECISION_HEAD`), no [V, E] one.
            transposed = (TRANSPOSED_LOW_PRECISION_HEAD and compute == torch.bfloat16
                          and device_type == "cpu")
            w_VE = None if transposed else weight_VE.to(compute)
            # fp32 CPU gradient matmuls on oneDNN where it is the faster library (linear.py):
            # the input gradient p @ w against one contiguous wᵀ, and the weight gradient as
            # hᵀ @ p, i.e. [E, V], summed over the chunks and transposed into place once.
            w_EV = grad_EV = None
            onednn_wgrad = not transposed and needs_grad and matmul_uses_onednn(
                min(chunk_size, hidden_NE.shape[0]), hidden_NE, w_VE, b_V
            ) and compute == accumulate
            if transposed:
                w_EV = (compiled_transposed_cast() if compiled else _transposed_cast)(
                    weight_VE, compute)
            elif needs_grad and matmul_uses_onednn(vocab_size, hidden_NE, w_VE):
                w_EV = transposed_copy(w_VE)

            def project(h_RE: torch.Tensor) -> torch.Tensor:
                """The logits of rows ``h_RE`` (in the compute dtype)."""
                if not transposed:
                    return linear(h_RE, w_VE, b_V)
                return h_RE @ w_EV if b_V is None else torch.addmm(b_V, h_RE, w_EV)
            if needs_grad and not onednn_wgrad:  # the accumulator of the chunks' products
                grad_weight_PE, grad_weight_VE = new_weight_grad()
            for start in range(0, hidden_NE.shape[0], chunk_size):
                h_CE = hidden_NE[start : start + chunk_size].to(compute)
                t_C = targets_N[start : start + chunk_size]
                v_C = valid_N[start : start + chunk_size]
                logits_CV = project(h_CE)
                safe_t_C = torch.where(v_C, t_C, torch.zeros_like(t_C))
                factor_C = None  # probs_CV × factor_C are the probabilities where given
                if compiled_kernel is not None:
                    lse_C, logit_t_C, probs_CV, factor_C = compiled_kernel(
                        logits_CV, safe_t_C, needs_grad)
                else:
                    lse_C, logit_t_C, probs_CV = _softmax_and_lse(
                        logits_CV, safe_t_C, needs_grad,
                        row_logits=lambda rows, h_CE=h_CE: project(h_CE[rows]),
                    )
                del logits_CV  # overwritten by probs_CV (fp32 eager, compiled), or no longer needed
                ce_sum += ((lse_C - logit_t_C) * v_C).sum()
                z_sum += (lse_C.square() * v_C).sum()
                if not needs_grad:
                    continue
                # dL/dlogits = scale·softmax − weight·onehot(t), a row scale and C single
                # entries: both are applied to the [C, E] operands and results of the two
                # gradient matmuls, never in a further pass over the [C, V] probabilities.
                weight_C1 = (v_C.to(accumulate) / denominator).unsqueeze(1)
                scale_C1 = weight_C1 * (1 + 2 * z_loss_coef * lse_C.to(accumulate).unsqueeze(1))
                if factor_C is not None:  # unnormalised exponentials: normalised by the scale
                    scale_C1 = scale_C1 * factor_C.to(accumulate).unsqueeze(1)
                p_CV = probs_CV.to(compute)
                del probs_CV  # an fp32 softmax of low-precision logits: freed once cast
                h_acc_CE = h_CE.to(accumulate)
                if transposed:
                    rows_CE = _blocked_input_grad(p_CV, w_EV, accumulate)
                    # the targets' rows of the weight as the [E, V] copy holds them: rounded
                    # from the [V, E] rows (contiguous) rather than gathered across its columns
                    target_w_CE = weight_VE[safe_t_C].to(compute)
                else:
                    rows_CE = (p_CV @ w_VE if w_EV is None else matmul(p_CV, w_EV.t()))
                    target_w_CE = w_VE[safe_t_C]
                rows_CE = rows_CE.to(accumulate).mul_(scale_C1)
                rows_CE.sub_(target_w_CE.to(accumulate) * weight_C1)
                del target_w_CE
                if start + chunk_size >= hidden_NE.shape[0]:  # their last use: a copy of
                    # the weight (wᵀ, or the low-precision w) is freed before the last
                    # weight-gradient product
                    w_EV = w_VE = None
                grad_hidden_NE[start : start + chunk_size] = rows_CE
                scaled_h_CE = (h_acc_CE * scale_C1).to(compute)
                first = start == 0  # beta 0 / copy: the empty accumulator is never read
                target_rows_CE = h_acc_CE * -weight_C1
                if onednn_wgrad:
                    part_EV = matmul(scaled_h_CE.t(), p_CV)
                    grad_EV = part_EV if first else grad_EV.add_(part_EV)
                    del part_EV
                    grad_EV.index_add_(1, safe_t_C, target_rows_CE.t())
                else:
                    if compute == accumulate:
                        grad_weight_VE.addmm_(p_CV.t(), scaled_h_CE, beta=0.0 if first else 1.0)
                    else:  # low-precision matmuls, fp32 accumulation across chunks, a block of
                        # vocab rows at a time: no [V, E] low-precision partial product (37 MB
                        # at 50,304 × 384 in bf16, at the loss's memory peak), same speed
                        for row in range(0, vocab_size, WGRAD_ROWS):
                            part_RE = p_CV[:, row : row + WGRAD_ROWS].t() @ scaled_h_CE
                            rows_RE = grad_weight_VE[row : row + WGRAD_ROWS]
                            (rows_RE.copy_ if first else rows_RE.add_)(part_RE)
                    grad_weight_VE.index_add_(0, safe_t_C, target_rows_CE)
                if grad_bias_V is not None:
                    grad_bias_V += (p_CV.t() @ scale_C1.to(compute)).squeeze(1).to(accumulate)
                    grad_bias_V.index_add_(0, safe_t_C, -weight_C1.squeeze(1))
                del p_CV  # freed before the next chunk's logits are allocated
            w_EV = None
            if needs_grad and grad_weight_PE is None:
                # oneDNN's [E, V] sum: the [P, E] gradient is allocated only now that the
                # chunks' [C, V] buffers are freed (77 MB off the peak for a 50k × 384 fp32 head)
                grad_weight_PE, grad_weight_VE = new_weight_grad()
                if grad_EV is not None:
                    transposed_copy(grad_EV, grad_weight_VE)
            del grad_EV
        ce_loss = ce_sum / denominator
        z_loss = z_loss_coef * z_sum / denominator
        if needs_grad:
            ctx.save_for_backward(grad_hidden_NE, grad_weight_PE, grad_bias_P)
            ctx.weight_dtype = weight_PE.dtype
        ce_out, z_out = ce_loss.clone(), z_loss.clone()
        ctx.mark_non_differentiable(ce_out, z_out, num_tokens)
        return ce_loss + z_loss, ce_out, z_out, num_tokens

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z, _grad_num):
        grad_hidden, grad_weight, grad_bias = scaled_head_grads(ctx, grad_loss)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None
