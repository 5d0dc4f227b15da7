"""How one forward's attention is masked: the `AttentionMask` value and the explicit-mask builder.

Its own module because both attention kernels (`attention.Attention`'s default and
`relative.RelativePositionXL.attend`) and the decoder that builds masks take it, and neither
kernel module should import the other for it.

Shape legend: B batch, H heads, Q query positions, T key positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from densetrain.models.positions import alibi_bias


@dataclass(frozen=True)
class MaskInputs:
    """What a forward's mask is made of, for layouts whose attention sees other keys than the
    module's own (context parallel gathers the keys of every cp rank and rebuilds the mask
    from these).

    ``positions_BQ`` are the queries' positions: the caller's ``positions_BS`` (global under
    context parallel, restarting per document with document masking) or the sequence indices.
    Within one document a position and an index differ by a constant, so distances, causality
    and windows computed from either agree wherever the document mask allows attention.
    """

    positions_BQ: torch.Tensor
    document_ids_BQ: torch.Tensor | None
    sliding_window: int | None
    alibi_slopes_H: torch.Tensor | None
    """The slopes of every head of the model (a tensor-parallel rank uses its own slice)."""
    dtype: torch.dtype


@dataclass(frozen=True)
class AttentionMask:
    """How the attention of one forward is masked: ``is_causal`` (no tensor) or ``mask``.

    ``mask`` is boolean [B or 1, 1, Q, T] (True = may attend) or an additive float bias
    [B, H, Q, T] (ALiBi, with -inf where attention is not allowed). ``inputs`` (not compared)
    say what the mask was built from (`MaskInputs`; None for KV-cache decoding), and
    ``head_start`` which head of the model the bias's first head is (tensor parallel: a rank's
    share of the heads, see `for_heads`).
    """

    is_causal: bool
    mask: torch.Tensor | None = None
    inputs: MaskInputs | None = field(default=None, compare=False)
    head_start: int = field(default=0, compare=False)

    def for_heads(self, start: int, count: int) -> AttentionMask:
        """This mask for the ``count`` heads from head ``start`` of the model (a per-head bias is
        sliced; a mask shared by every head is kept)."""
        mask = self.mask
        if mask is not None and mask.shape[1] > 1:
            mask = mask[:, start : start + count]
        return replace(self, mask=mask, head_start=self.head_start + start)


def build_attention_mask(
    *,
    q_index_BQ: torch.Tensor,
    k_index_BT: torch.Tensor,
    sliding_window: int | None,
    q_doc_BQ: torch.Tensor | None = None,
    k_doc_BT: torch.Tensor | None = None,
    alibi_slopes_H: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionMask:
    """Explicit mask from absolute token indices (and document ids): causal, windowed, per doc.

    Keys with a negative index are empty cache slots and are never attended. With ALiBi the
    result is an additive bias (distance uses the same indices, so positions restarting per
    document give the same bias: cross-document pairs are masked anyway).
    """
    q_BQ1 = q_index_BQ.unsqueeze(-1)
    k_B1T = k_index_BT.unsqueeze(-2)
    allowed_BQT = (k_B1T <= q_BQ1) & (k_B1T >= 0)
    if sliding_window is not None:
        allowed_BQT = allowed_BQT & (q_BQ1 - k_B1T < sliding_window)
    if q_doc_BQ is not None and k_doc_BT is not None:
        allowed_BQT = allowed_BQT & (q_doc_BQ.unsqueeze(-1) == k_doc_BT.unsqueeze(-2))
    allowed_B1QT = allowed_BQT.unsqueeze(1)
    if alibi_slopes_H is None:
        return AttentionMask(is_causal=False, mask=allowed_B1QT)
    bias_BHQT = alibi_bias(alibi_slopes_H, q_index_BQ, k_index_BT)
    bias_BHQT = bias_BHQT.masked_fill(~allowed_B1QT, float("-inf")).to(dtype)
    return AttentionMask(is_causal=False, mask=bias_BHQT)
