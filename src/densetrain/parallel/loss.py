"""Vocab-parallel cross-entropy (Megatron-LM, Shoeybi et al. 2019 §3): the loss over logits
whose vocab dimension is sharded across the tp ranks, without gathering them.

Each rank holds logits for its slice of the vocabulary. The softmax needs three all-reduces of
one number per token (the max, the sum of exponentials, the target's logit); the gradient
(softmax − one-hot) is local, so backward needs no communication.

Hand-written because ``torch.distributed.tensor.parallel.loss_parallel`` requires the backward
pass to run inside its context manager, which the trainer's step (backward outside the loss
function) does not do.

``vocab_parallel_chunked_loss`` fuses the local output projection with that loss and runs it
``chunk_size`` tokens at a time, in the manner of ``densetrain.models.loss.chunked_lm_loss``:
the [N, L] logits never exist in full (a chunk peaks at [C, L]), and the input gradients are
computed during the forward pass, so backward only scales the saved [N, E] / [L, E] gradients.
It needs two all-reduces of [C]-sized values per chunk (the max; the sum of exponentials and the
target's logit together) and, like the unchunked loss, none in backward: the hidden-state
gradient it returns is this rank's partial sum over its vocab slice, which the caller's DTensor
reduces.

Shape legend: N tokens, C tokens in a chunk, E hidden width, L local vocab slice (padding
rows included).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelNLL(torch.autograd.Function):
    """(nll_N, lse_N) from local logits [N, L] covering global vocab ids [offset, offset + L)."""

    @staticmethod
    def forward(ctx, logits_NL, targets_N, offset, valid_cols, group):
        logits_NL = logits_NL.float()
        if valid_cols < logits_NL.shape[1]:  # vocab padding rows never take part
            logits_NL = logits_NL.clone()
            logits_NL[:, max(valid_cols, 0):] = float("-inf")
        max_N = logits_NL.max(dim=1).values
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
        shifted_NL = logits_NL - max_N.unsqueeze(1)
        exp_NL = shifted_NL.exp()
        sum_N = exp_NL.sum(dim=1)
        dist.all_reduce(sum_N, group=group)
        local_target_N = targets_N - offset
        in_slice_N = (local_target_N >= 0) & (local_target_N < logits_NL.shape[1])
        index_N = local_target_N.clamp(0, logits_NL.shape[1] - 1)
        # where, not a product: a rank of padding rows only would read −inf (and 0 · −inf = NaN)
        target_logit_N = torch.where(
            in_slice_N, shifted_NL.gather(1, index_N.unsqueeze(1)).squeeze(1), 0.0
        )
        dist.all_reduce(target_logit_N, group=group)
        lse_shifted_N = sum_N.log()
        nll_N = lse_shifted_N - target_logit_N
        ctx.save_for_backward(exp_NL / sum_N.unsqueeze(1), index_N, in_slice_N)
        return nll_N, lse_shifted_N + max_N

    @staticmethod
    def backward(ctx, grad_nll_N, grad_lse_N):
        softmax_NL, index_N, in_slice_N = ctx.saved_tensors
        grad_nll_N = torch.zeros_like(softmax_NL[:, 0]) if grad_nll_N is None else grad_nll_N
        grad_lse_N = torch.zeros_like(grad_nll_N) if grad_lse_N is None else grad_lse_N
        grad_NL = softmax_NL * (grad_nll_N + grad_lse_N).unsqueeze(1)
        rows_N = torch.arange(grad_NL.shape[0], device=grad_NL.device)
        grad_NL[rows_N, index_N] -= grad_nll_N * in_slice_N
        return grad_NL, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_NL: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    vocab_offset: int,
    vocab_size: int,
    group: dist.ProcessGroup,
    ignore_index: int = -100,
    z_loss_coef: float = 0.0,
):
    """Mean cross-entropy (+ PaLM z-loss) over non-ignored targets from vocab-sharded logits.

    Returns ``densetrain.models.loss.LossOutput`` with the same definition as
    ``cross_entropy_loss`` (identical on every tp rank).
    """
    from densetrain.models.loss import LossOutput

    valid_N = targets_N != ignore_index
    safe_targets_N = torch.where(valid_N, targets_N, torch.zeros_like(targets_N))
    nll_N, lse_N = _VocabParallelNLL.apply(
        logits_NL, safe_targets_N, vocab_offset, vocab_size - vocab_offset, group
    )
    num_tokens = valid_N.sum()
    denominator = num_tokens.clamp(min=1).float()
    ce_loss = (nll_N * valid_N).sum() / denominator
    if z_loss_coef > 0:
        z_loss = z_loss_coef * (lse_N.square() * valid_N).sum() / denominator
    else:
        z_loss = torch.zeros((), device=logits_NL.device)
    loss = ce_loss + z_loss
    return LossOutput(loss, ce_loss.detach(), z_loss.detach(), num_tokens)


def _mask_padding(work_CL: torch.Tensor, valid_cols: int) -> None:
    """Set the columns of vocab padding rows (local column ``valid_cols`` on) to −inf in place:
    they never take part in the softmax, and their exponentials are exactly 0."""
    if valid_cols < work_CL.shape[1]:
        work_CL[:, max(valid_cols, 0):] = float("-inf")


class _VocabParallelChunkedLoss(torch.autograd.Function):
    """Fused local projection + vocab-parallel loss, ``chunk_size`` tokens at a time, whose
    forward also produces the gradients of hidden [N, E], local weight [L, E] and bias [L]."""

    @staticmethod
    def forward(
        ctx,
        hidden_NE,
        weight_LE,
        bias_L,
        targets_N,
        offset,
        valid_cols,
        chunk_size,
        ignore_index,
        z_loss_coef,
        needs_grad,
        group,
    ):
        from densetrain.models.loss import WGRAD_ROWS

        rows = weight_LE.shape[0]
        valid_N = targets_N != ignore_index
        num_tokens = valid_N.sum()
        denominator = num_tokens.clamp(min=1).float()
        device = hidden_NE.device
        ce_sum = torch.zeros((), dtype=torch.float32, device=device)
        z_sum = torch.zeros((), dtype=torch.float32, device=device)
        accumulate = torch.promote_types(weight_LE.dtype, torch.float32)
        grad_hidden_NE = grad_weight_LE = grad_bias_L = None
        if needs_grad:
            grad_hidden_NE = torch.empty_like(hidden_NE)
            # summed over the chunks (zeros: also the gradient of an empty micro-batch and of
            # the padding rows, whose probabilities are exactly 0)
            grad_weight_LE = torch.zeros_like(weight_LE, dtype=accumulate)
            if bias_L is not None:
                grad_bias_L = torch.zeros_like(bias_L, dtype=accumulate)
        # As in `_ChunkedLMLoss`: the matmuls run in the autocast dtype when autocast is on,
        # else the hidden states' dtype, with autocast switched off inside (no per-chunk re-cast
        # of the weight); the softmax and all the reductions are in fp32.
        device_type = device.type
        compute = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else hidden_NE.dtype
        )
        with torch.autocast(device_type, enabled=False):
            w_LE = weight_LE.to(compute)
            b_L = bias_L.to(compute) if bias_L is not None else None
            for start in range(0, hidden_NE.shape[0], chunk_size):
                h_CE = hidden_NE[start : start + chunk_size].to(compute)
                t_C = targets_N[start : start + chunk_size]
                v_C = valid_N[start : start + chunk_size]
                logits_CL = torch.nn.functional.linear(h_CE, w_LE, b_L)
                # one fp32 buffer per chunk (fp32 logits themselves, else one fp32 copy): the
                # logits, then shifted, then exponentials, then the logits' gradient
                work_CL = logits_CL.float()
                del logits_CL
                _mask_padding(work_CL, valid_cols)
                max_C = work_CL.amax(dim=1)
                dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=group)
                work_CL.sub_(max_C.unsqueeze(1))
                # ignored targets read column 0 of rank 0's slice: their weight is 0 below
                safe_t_C = torch.where(v_C, t_C, torch.zeros_like(t_C))
                local_t_C = safe_t_C - offset
                in_slice_C = (local_t_C >= 0) & (local_t_C < rows)
                index_C1 = local_t_C.clamp(0, rows - 1).unsqueeze(1)
                # where, not a product: a padding column is −inf (and 0 · −inf = NaN)
                target_C = torch.where(in_slice_C, work_CL.gather(1, index_C1).squeeze(1), 0.0)
                work_CL.exp_()
                # [2, C]: Σ exp(logit − max) and the target's shifted logit, one all-reduce
                sums_2C = torch.stack((work_CL.sum(dim=1), target_C))
                dist.all_reduce(sums_2C, group=group)
                sum_C, target_C = sums_2C[0], sums_2C[1]
                log_sum_C = sum_C.log()
                lse_C = log_sum_C + max_C
                ce_sum += ((log_sum_C - target_C) * v_C).sum()
                z_sum += (lse_C.square() * v_C).sum()
                if not needs_grad:
                    continue
                # dL/dlogits = scale·softmax − weight·onehot(t), weight = valid / num_tokens
                # and scale = weight·(1 + 2·z·lse) (CE, plus z-loss's 2·z·lse·softmax)
                weight_C = v_C.to(torch.float32) / denominator
                scale_C = weight_C * (1 + 2 * z_loss_coef * lse_C)
                work_CL.mul_((scale_C / sum_C).unsqueeze(1))
                work_CL.scatter_add_(1, index_C1, (-weight_C * in_slice_C).unsqueeze(1))
                g_CL = work_CL.to(compute)
                del work_CL  # an fp32 buffer of low-precision logits: freed once cast
                grad_hidden_NE[start : start + chunk_size] = g_CL @ w_LE
                if compute == accumulate:
                    grad_weight_LE.addmm_(g_CL.t(), h_CE)
                else:  # low-precision products, fp32 sum, a block of vocab rows at a time
                    for row in range(0, rows, WGRAD_ROWS):
                        grad_weight_LE[row : row + WGRAD_ROWS] += (
                            g_CL[:, row : row + WGRAD_ROWS].t() @ h_CE
                        )
                if grad_bias_L is not None:
                    grad_bias_L += g_CL.sum(dim=0, dtype=accumulate)
                del g_CL  # freed before the next chunk's logits are allocated
        ce_loss = ce_sum / denominator
        z_loss = z_loss_coef * z_sum / denominator
        if needs_grad:
            ctx.save_for_backward(grad_hidden_NE, grad_weight_LE, grad_bias_L)
            ctx.weight_dtype = weight_LE.dtype
        ce_out, z_out = ce_loss.clone(), z_loss.clone()
        ctx.mark_non_differentiable(ce_out, z_out, num_tokens)
        return ce_loss + z_loss, ce_out, z_out, num_tokens

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z, _grad_num):
        from densetrain.models.loss import scaled_head_grads

        grad_hidden, grad_weight, grad_bias = scaled_head_grads(ctx, grad_loss)
        return (grad_hidden, grad_weight, grad_bias) + (None,) * 8


def vocab_parallel_chunked_loss(
    hidden_NE: torch.Tensor,
    weight_LE: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    vocab_offset: int,
    vocab_size: int,
    group: dist.ProcessGroup,
    chunk_size: int,
    bias_L: torch.Tensor | None = None,
    ignore_index: int = -100,
    z_loss_coef: float = 0.0,
):
    """``vocab_parallel_cross_entropy(F.linear(hidden, weight, bias), targets, ...)`` fused and
    run ``chunk_size`` tokens at a time: the same `LossOutput` (identical on every tp rank) and
    the same gradients, but it peaks at [chunk_size, L] logits instead of [N, L].

    ``weight_LE`` / ``bias_L`` are this rank's rows of the (padded) head, covering global vocab
    ids [vocab_offset, vocab_offset + L); rows at or beyond ``vocab_size`` (padding) never take
    part and get zero gradients. The gradient of ``hidden_NE`` is this rank's partial sum: the
    caller sums it over the tp ranks (a ``Partial`` DTensor gradient).
    """
    from densetrain.models.loss import LossOutput

    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    needs_grad = torch.is_grad_enabled() and (
        hidden_NE.requires_grad
        or weight_LE.requires_grad
        or (bias_L is not None and bias_L.requires_grad)
    )
    loss, ce_loss, z_loss, num_tokens = _VocabParallelChunkedLoss.apply(
        hidden_NE, weight_LE, bias_L, targets_N, vocab_offset, vocab_size - vocab_offset,
        chunk_size, ignore_index, z_loss_coef, needs_grad, group,
    )
    return LossOutput(loss, ce_loss.detach(), z_loss.detach(), num_tokens)
