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
import torch.distributed as dist
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


class _GatheredMask:
    """The cp mask of one forward, built once and shared by every layer (they get the same
    `AttentionMask` object): the gathered key positions and document ids need a collective,
    and an ALiBi bias is as large as the scores."""

    def __init__(self) -> None:
        self.source = None
        self.head_start = -1
        self.value = None


class ContextParallelAttention:
    """The `AttentionFn` of one attention module under context parallel: keys and values are
    all-gathered over the cp group and each local query is masked by the global positions of
    the gathered keys (exact attention over the whole sequence).

    The plain causal mask needs no more than the load-balanced layout (`local_positions`).
    Otherwise the mask is rebuilt from the forward's `MaskInputs` — the queries' global
    positions (restarting per document), document ids, window and ALiBi slopes — against the
    same of the gathered keys, so it is the one-process mask's rows for this rank's queries.
    With ``relative`` (a layer's `RelativePositionXL`) the Transformer-XL position scores are
    taken at the global distances of each query and key.
    """

    def __init__(self, group, cp_size: int, cp_rank: int, *, relative=None,
                 shared: _GatheredMask | None = None) -> None:
        self.group = group
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.relative = relative
        self._shared = shared if shared is not None else _GatheredMask()

    def __call__(self, q_BHSK, k_BGTK, v_BGTK, mask, *, dropout_p: float, enable_gqa: bool):
        """Attention of this rank's queries over the keys of every cp rank."""
        from densetrain.models.attention import scaled_dot_product
        from densetrain.models.masks import AttentionMask

        cp, group = self.cp_size, self.group
        seq_len = q_BHSK.shape[2] * cp
        k_all = _all_gather_autograd(k_BGTK.contiguous(), gather_dim=2, group=group)
        v_all = _all_gather_autograd(v_BGTK.contiguous(), gather_dim=2, group=group)
        if self._plain_causal(mask, seq_len):
            q_pos_1S, k_pos_1T = self._balanced_positions(seq_len, q_BHSK.device)
            allowed_11ST = (k_pos_1T.unsqueeze(1) <= q_pos_1S.unsqueeze(2)).unsqueeze(1)
            cp_mask = AttentionMask(is_causal=False, mask=allowed_11ST)
        else:
            if mask.inputs is None:
                raise UserError("context parallel needs the mask's inputs (positions, document "
                                "ids); KV-cache decoding does not run under parallel.cp > 1")
            cp_mask, q_pos_1S, k_pos_1T = self._gathered_mask(mask, q_BHSK.shape[1])
        if self.relative is None:
            return scaled_dot_product(q_BHSK, k_all, v_all, cp_mask, dropout_p=dropout_p,
                                      enable_gqa=enable_gqa)
        if cp_mask.mask.dtype != torch.bool:
            raise ValueError("relative_xl attention takes a boolean mask, not an additive bias")
        distances_BST = q_pos_1S.unsqueeze(-1) - k_pos_1T.unsqueeze(-2)
        scores_BHST = self.relative.position_scores_at(q_BHSK, distances_BST, seq_len)
        return self.relative.attend_scored(q_BHSK, k_all, v_all, scores_BHST, cp_mask.mask,
                                           dropout_p=dropout_p, enable_gqa=enable_gqa)

    @staticmethod
    def _plain_causal(mask, seq_len: int) -> bool:
        inputs = mask.inputs
        if inputs is None:
            return mask.is_causal
        window = inputs.sliding_window
        return (inputs.alibi_slopes_H is None and inputs.document_ids_BQ is None
                and (window is None or window >= seq_len))

    def _balanced_positions(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions [1, S/cp] of this rank's queries and [1, S] of the gathered keys."""
        cp = self.cp_size
        q_pos_S = local_positions(seq_len, self.cp_rank, cp)
        k_pos_T = torch.cat([local_positions(seq_len, r, cp) for r in range(cp)])
        return q_pos_S.to(device).unsqueeze(0), k_pos_T.to(device).unsqueeze(0)

    @torch.compiler.disable
    def _gathered_mask(self, mask, num_heads: int):
        """(cp mask, query positions [B, S/cp], key positions [B, S]) from ``mask.inputs``,
        cached for the forward's other layers."""
        from densetrain.models.masks import build_attention_mask

        shared = self._shared
        if shared.source is mask.inputs and shared.head_start == mask.head_start:
            return shared.value
        inputs = mask.inputs
        batch = inputs.positions_BQ.shape[0]
        docs_BQ = inputs.document_ids_BQ
        if docs_BQ is not None:
            batch = max(batch, docs_BQ.shape[0])
        q_pos_BS = inputs.positions_BQ.expand(batch, -1).contiguous()
        k_pos_BT = self._gather_sequence(q_pos_BS)
        k_docs_BT = None if docs_BQ is None else self._gather_sequence(docs_BQ.contiguous())
        slopes_H = inputs.alibi_slopes_H
        if slopes_H is not None:
            slopes_H = slopes_H[mask.head_start : mask.head_start + num_heads]
        window = inputs.sliding_window
        built = build_attention_mask(
            q_index_BQ=q_pos_BS, k_index_BT=k_pos_BT,
            sliding_window=window if window is not None and window < k_pos_BT.shape[1] else None,
            q_doc_BQ=docs_BQ, k_doc_BT=k_docs_BT, alibi_slopes_H=slopes_H, dtype=inputs.dtype,
        )
        shared.source, shared.head_start = inputs, mask.head_start
        shared.value = (built, q_pos_BS, k_pos_BT)
        return shared.value

    def _gather_sequence(self, x_BS: torch.Tensor) -> torch.Tensor:
        """[B, S/cp] of every cp rank, concatenated in rank order ([B, S]): the order of the
        gathered keys. Integer data, no gradient."""
        parts = [torch.empty_like(x_BS) for _ in range(self.cp_size)]
        dist.all_gather(parts, x_BS, group=self.group)
        return torch.cat(parts, dim=1)


def apply_context_parallel(model: nn.Module, cp_mesh) -> nn.Module:
    """Make every attention of ``model`` attend over the keys of all cp ranks (in place), by
    setting each `Attention` module's public ``attention_fn``.

    The caller feeds each rank ``shard_sequence(tokens)`` with the matching targets and
    ``positions_BS = local_positions(S, cp_rank, cp)``; with document masking, the shards of the
    document ids and of the positions restarting per document over the whole sequence
    (`Transformer`'s ``document_positions``).
    """
    from densetrain.models.attention import Attention

    group, size, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    shared = _GatheredMask()
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_fn = ContextParallelAttention(group, size, rank,
                                                           relative=module.relative,
                                                           shared=shared)
    return model
