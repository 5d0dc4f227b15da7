"""Vocab-parallel cross-entropy (Megatron-LM, Shoeybi et al. 2019 §3): the loss over logits
whose vocab dimension is sharded across the tp ranks, without gathering them.

Each rank holds logits for its slice of the vocabulary. The softmax needs three all-reduces of
one number per token (the max, the sum of exponentials, the target's logit); the gradient
(softmax − one-hot) is local, so backward needs no communication.

Hand-written because ``torch.distributed.tensor.parallel.loss_parallel`` requires the backward
pass to run inside its context manager, which the trainer's step (backward outside the loss
function) does not do.

Shape legend: N tokens, L local vocab slice.
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
        target_logit_N = shifted_NL.gather(1, index_N.unsqueeze(1)).squeeze(1) * in_slice_N
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
