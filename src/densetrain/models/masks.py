"""How one forward's attention is masked: the `AttentionMask` value and the explicit-mask builder.

Its own module because both attention kernels (`attention.Attention`'s default and
`relative.RelativePositionXL.attend`) and the decoder that builds masks take it, and neither
kernel module should import the other for it.

Shape legend: B batch, H heads, Q query positions, T key positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densetrain.models.positions import alibi_bias


@dataclass(frozen=True)
class AttentionMask:
    """How the attention of one forward is masked: ``is_causal`` (no tensor) or ``mask``.

    ``mask`` is boolean [B or 1, 1, Q, T] (True = may attend) or an additive float bias
    [B, H, Q, T] (ALiBi, with -inf where attention is not allowed).
    """

    is_causal: bool
    mask: torch.Tensor | None = None


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
