"""Context parallel: the sequence sharded over cp ranks with exact causal attention.

Load balance (Llama 3, Dubey et al. 2024 §3.3.2; also Megatron-LM's CP): the sequence is cut
into 2·cp chunks and rank r holds chunks r and 2·cp − 1 − r, so every rank has the same amount
of causal-mask work. Attention all-gathers keys and values over the cp group (Llama 3's choice
over ring attention: simpler and exact; the K/V all-gather is small for GQA) and masks each
local query by the global positions of the gathered keys. The gradient of the all-gather is a
reduce-scatter.

Hand-written because ``torch.distributed.tensor.experimental.context_parallel`` dispatches on
the CUDA flash/efficient SDPA kernels and does not cover the CPU SDPA op on gloo, and because
it must also handle the model's GQA kv expansion.
"""

from __future__ import annotations

import torch
from torch import nn

from densetrain.errors import UserError

try:  # torch >= 2.13 renamed the differentiable all-gather (the old name warns, deprecated)
    from torch.distributed._functional_collectives import (
        all_gather_single_autograd as _all_gather_autograd,
    )
except ImportError:  # older torch
    from torch.distributed._functional_collectives import (
        all_gather_tensor_autograd as _all_gather_autograd,
    )


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of 2·cp) that rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global positions [seq_len / cp] of this rank's tokens, in its local order."""
    if seq_len % (2 * cp) != 0:
        raise UserError(f"sequence length {seq_len} must be a multiple of 2 × cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk),
         torch.arange(second * chunk, (second + 1) * chunk)]
    )


def shard_sequence(x_BS: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of ``x_BS`` ([B, S, ...] → [B, S / cp, ...]) in load-balanced order."""
    return x_BS[:, local_positions(x_BS.shape[1], cp_rank, cp).to(x_BS.device)]


class ContextParallelAttention:
    """The `AttentionFn` of one attention module under context parallel: keys and values are
    all-gathered over the cp group and each local query is masked by the global positions of
    the gathered keys (exact causal attention over the whole sequence)."""

    def __init__(self, group, cp_size: int, cp_rank: int) -> None:
        self.group = group
        self.cp_size = cp_size
        self.cp_rank = cp_rank

    def __call__(self, q_BHSK, k_BGTK, v_BGTK, mask, *, dropout_p: float, enable_gqa: bool):
        """Attention of this rank's queries over the keys of every cp rank."""
        from densetrain.models.attention import scaled_dot_product
        from densetrain.models.masks import AttentionMask

        if not mask.is_causal:
            raise UserError(
                "context parallel supports the plain causal mask only (no document masks, ALiBi "
                "or sliding windows shorter than the sequence)"
            )
        cp, cp_rank, group = self.cp_size, self.cp_rank, self.group
        seq_len = q_BHSK.shape[2] * cp
        k_all = _all_gather_autograd(k_BGTK.contiguous(), gather_dim=2, group=group)
        v_all = _all_gather_autograd(v_BGTK.contiguous(), gather_dim=2, group=group)
        device = q_BHSK.device
        q_pos_S = local_positions(seq_len, cp_rank, cp).to(device)
        k_pos_T = torch.cat([local_positions(seq_len, r, cp) for r in range(cp)]).to(device)
        allowed_11ST = (k_pos_T.unsqueeze(0) <= q_pos_S.unsqueeze(1))[None, None]
        cp_mask = AttentionMask(is_causal=False, mask=allowed_11ST)
        return scaled_dot_product(q_BHSK, k_all, v_all, cp_mask, dropout_p=dropout_p,
                                  enable_gqa=enable_gqa)


def apply_context_parallel(model: nn.Module, cp_mesh) -> nn.Module:
    """Make every attention of ``model`` attend over the keys of all cp ranks (in place), by
    setting each `Attention` module's public ``attention_fn``.

    The caller feeds each rank ``shard_sequence(tokens)`` with
    ``positions_BS = local_positions(S, cp_rank, cp)`` and the matching targets.
    """
    from densetrain.models.attention import Attention

    attention = ContextParallelAttention(cp_mesh.get_group(), cp_mesh.size(),
                                         cp_mesh.get_local_rank())
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_fn = attention
    return model
