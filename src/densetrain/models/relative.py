"""Transformer-XL relative position attention (Dai et al. 2019, §3.3), as used by Gopher and
Chinchilla (Rae et al. 2021, §3; Hoffmann et al. 2022, §4.2).

The attention score of query i and key j is

    A_ij = q_i·k_j + q_i·W_R R_{i-j} + u·k_j + v·W_R R_{i-j}
         = (q_i + u)·k_j + (q_i + v)·W_R R_{i-j},

with R_r the sinusoid of relative distance r (``dim`` wide: the sines, then the cosines, of
r·10000^(-2m/dim); Dai et al. 2019 §3.3 and Vaswani et al. 2017 §3.5), W_R a [q_dim, dim]
projection of those sinusoids to per-head position keys, and u, v learned per-head vectors
(per layer, as in Table A4's d² + 2d position parameters per layer of Hoffmann et al. 2022).
The content term goes through ``scaled_dot_product_attention`` with q + u as the query; the
position term (q + v)·W_R R is computed for the T distances T-1 .. 0 once, then moved to its
(i, j) place by the relative shift of Dai et al. 2019, Appendix B (pad one column, view the
[S, T+1] rows as [T+1, S], drop the first row), and passed as the additive mask. The SxT
position-score tensor is inherent to the method (it depends on the query), so its memory is
that of an explicit attention mask.

Distances are differences of sequence indices (query i of S new tokens sits at key index
T - S + i: keys from a KV cache come first, in order, as in Transformer-XL's memory), so a
document mask keeps the within-document distances and ``positions_BS`` is not read.
u and v start at zero (they are bias vectors, initialised like every other bias), W_R like
every other linear weight.

Shape legend: B batch, H heads, G kv heads, S query positions, T key positions, K head_dim,
D dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from densetrain.models.config import ModelConfig
from densetrain.models.linear import Linear
from densetrain.models.masks import AttentionMask


def relative_sinusoids(
    distances_T: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Sinusoids R_r of the relative distances ``distances_T`` ([T]) as [T, dim] in ``dtype``
    (at least fp32): [sin(r·f_0) .. sin(r·f_{dim/2-1}), cos(r·f_0) .. cos(r·f_{dim/2-1})],
    f_m = 10000^(-2m/dim)."""
    dtype = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, dim, 2, device=distances_T.device).to(dtype) / dim
    inv_freq = 1.0 / (10000.0**exponents)
    angles_TF = distances_T.to(dtype).unsqueeze(-1) * inv_freq
    return torch.cat([angles_TF.sin(), angles_TF.cos()], dim=-1)


def relative_shift(scores_BHSM: torch.Tensor) -> torch.Tensor:
    """Dai et al. 2019, Appendix B: from scores over distances T-1 .. 0 (column m is distance
    T-1-m) to scores over keys, ``out[..., i, j] = in[..., i, j + S-1-i]`` for j <= i + T - S.

    Entries above that causal diagonal hold values of other rows and must be masked.
    """
    batch, heads, seq, keys = scores_BHSM.shape
    padded_BHSP = F.pad(scores_BHSM, (1, 0))
    shifted_BHPS = padded_BHSP.view(batch, heads, keys + 1, seq)[:, :, 1:]
    return shifted_BHPS.reshape(batch, heads, seq, keys)


class HeadBias(nn.Module):
    """One learned vector per head, stored flat as ``bias`` [H·K] (so it is initialised and
    kept out of weight decay like any other bias)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self) -> torch.Tensor:
        """The vector [H·K] (tensor parallel returns this rank's heads' slice)."""
        return self.bias


class RelativePositionXL(nn.Module):
    """Parameters of one layer's relative attention (W_R, u, v) and its `AttentionFn`
    (``attend``), which `Attention` installs as its ``attention_fn``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dim = config.dim
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.pos_proj = Linear(config.dim, config.q_dim, bias=False)
        """W_R: sinusoids [dim] -> position keys of every query head [q_dim]."""
        self.content_bias = HeadBias(config.q_dim)
        """u: the query-independent bias of the content score u·k_j."""
        self.position_bias = HeadBias(config.q_dim)
        """v: the query-independent bias of the position score v·W_R R_{i-j}."""

    def _distance_scores(self, q_BHSK: torch.Tensor, distances_M: torch.Tensor) -> torch.Tensor:
        """(q_i + v)·W_R R_r for every query i and each distance r of ``distances_M``:
        [B, H, S, M] in q's dtype."""
        heads, k_dim = self.num_heads, self.head_dim
        weight_dtype = self.pos_proj.weight.dtype
        sinusoids_MD = relative_sinusoids(distances_M, self.dim, weight_dtype).to(weight_dtype)
        pos_keys_HMK = self.pos_proj(sinusoids_MD).view(-1, heads, k_dim).transpose(0, 1)
        v_1H1K = self.position_bias().view(1, heads, 1, k_dim).to(q_BHSK.dtype)
        return torch.matmul(q_BHSK + v_1H1K, pos_keys_HMK.to(q_BHSK.dtype).mT)

    def position_scores(self, q_BHSK: torch.Tensor, num_keys: int) -> torch.Tensor:
        """(q_i + v)·W_R R_{i-j} for every query i and key j, [B, H, S, T] in q's dtype
        (entries of keys after the query are not meaningful)."""
        distances_T = torch.arange(num_keys - 1, -1, -1, device=q_BHSK.device)
        return relative_shift(self._distance_scores(q_BHSK, distances_T))

    def position_scores_at(self, q_BHSK: torch.Tensor, distances_BST: torch.Tensor,
                           num_distances: int) -> torch.Tensor:
        """(q_i + v)·W_R R_{i-j} for queries and keys that are not contiguous (context parallel
        holds two chunks of the sequence): ``distances_BST`` ([B or 1, S, T]) gives i - j per
        pair, [B, H, S, T] in q's dtype. Scores are computed for distances 0 .. num_distances-1
        and picked per pair, since the relative shift needs contiguous queries; pairs outside
        that range (keys after the query) are not meaningful and must be masked."""
        distances_M = torch.arange(num_distances, device=q_BHSK.device)
        scores_BHSM = self._distance_scores(q_BHSK, distances_M)
        batch, heads, seq, _ = scores_BHSM.shape
        index_BHST = distances_BST.clamp(0, num_distances - 1).unsqueeze(1).expand(
            batch, heads, seq, distances_BST.shape[-1])
        return scores_BHSM.gather(-1, index_BHST)

    def attend(
        self,
        q_BHSK: torch.Tensor,
        k_BGTK: torch.Tensor,
        v_BGTK: torch.Tensor,
        mask: AttentionMask,
        *,
        dropout_p: float,
        enable_gqa: bool,
    ) -> torch.Tensor:
        """The relative `AttentionFn`: softmax(((q+u)·k + (q+v)·W_R R) / sqrt(K)) @ v."""
        seq, keys = q_BHSK.shape[2], k_BGTK.shape[2]
        if mask.mask is not None and mask.mask.dtype != torch.bool:
            raise ValueError("relative_xl attention takes a boolean mask, not an additive bias")
        bias_BHST = self.position_scores(q_BHSK, keys)
        if mask.is_causal:
            q_index_S1 = torch.arange(keys - seq, keys, device=q_BHSK.device).unsqueeze(-1)
            allowed = torch.arange(keys, device=q_BHSK.device) <= q_index_S1
        else:
            allowed = mask.mask
        return self.attend_scored(q_BHSK, k_BGTK, v_BGTK, bias_BHST, allowed,
                                  dropout_p=dropout_p, enable_gqa=enable_gqa)

    def attend_scored(
        self,
        q_BHSK: torch.Tensor,
        k_BGTK: torch.Tensor,
        v_BGTK: torch.Tensor,
        position_scores_BHST: torch.Tensor,
        allowed_B1ST: torch.Tensor,
        *,
        dropout_p: float,
        enable_gqa: bool,
    ) -> torch.Tensor:
        """softmax(((q+u)·k + position scores) / sqrt(K)) @ v where ``allowed_B1ST`` (boolean)
        allows: the part of `attend` after the position scores, shared with context parallel."""
        bias_BHST = position_scores_BHST * self.head_dim**-0.5
        bias_BHST = bias_BHST.masked_fill(~allowed_B1ST, float("-inf"))
        u_1H1K = self.content_bias().view(1, self.num_heads, 1, self.head_dim)
        return F.scaled_dot_product_attention(
            q_BHSK + u_1H1K.to(q_BHSK.dtype),
            k_BGTK,
            v_BGTK,
            attn_mask=bias_BHST,
            dropout_p=dropout_p,
            enable_gqa=enable_gqa,
        )
