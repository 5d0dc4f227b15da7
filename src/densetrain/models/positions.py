"""Position information: rotary embeddings (RoPE) and ALiBi slopes.

RoPE (Su et al. 2021) uses the half-split layout: within the rotated part of a head, dim ``i``
pairs with dim ``i + rotary_dim/2`` (the layout of GPT-NeoX and of Hugging Face's
``rotate_half``). Only the first ``rotary_dim = head_dim * rotary_fraction`` dims are rotated
(GPT-NeoX uses 0.25); the rest pass through. Frequencies may be rescaled as in Llama 3.1.

Everything here is computed on the fly from the config and the positions (no buffers), so a
model built on the meta device needs nothing recomputed after ``to_empty()``; the cost is a few
element-wise ops on a [S, rotary_dim/2] table per forward, negligible next to one layer.

Shape legend: B batch, S sequence, H heads, K head_dim, R rotary_dim // 2.
"""

from __future__ import annotations

import math

import torch

from densetrain.models.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/rotary_dim), i < rotary_dim/2, fp32, Llama-3.1-scaled."""
    rotary_dim = config.rotary_dim
    exponents_R = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq_R = 1.0 / (config.rope_theta ** (exponents_R / rotary_dim))
    if config.rope_scaling is not None:
        inv_freq_R = _llama3_scale(inv_freq_R, config.rope_scaling)
    return inv_freq_R


def _llama3_scale(inv_freq_R: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, short ones kept,
    the band between interpolated linearly in ``original_max_seq_len / wavelength``."""
    wavelen_R = 2 * math.pi / inv_freq_R
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth_R = (scaling.original_max_seq_len / wavelen_R - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed_R = (1 - smooth_R) * inv_freq_R / scaling.factor + smooth_R * inv_freq_R
    scaled_R = torch.where(wavelen_R > low_freq_wavelen, inv_freq_R / scaling.factor, inv_freq_R)
    is_medium_R = (wavelen_R >= high_freq_wavelen) & (wavelen_R <= low_freq_wavelen)
    return torch.where(is_medium_R, smoothed_R, scaled_R)


def rope_cos_sin(
    config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for ``positions`` ([S] or [B, S]) as [B or 1, S, 1, R] in ``dtype``.

    The angles are computed in fp32 (positions times inverse frequencies) before the cast.
    """
    inv_freq_R = rope_inv_freq(config, positions.device)
    positions_BS = positions if positions.dim() == 2 else positions.unsqueeze(0)
    angles_BSR = positions_BS.float().unsqueeze(-1) * inv_freq_R
    cos_BS1R = angles_BSR.cos().unsqueeze(2).to(dtype)
    sin_BS1R = angles_BSR.sin().unsqueeze(2).to(dtype)
    return cos_BS1R, sin_BS1R


def _rotate(x_BSHK: torch.Tensor, cos_BS1R: torch.Tensor, sin_BS1R: torch.Tensor) -> torch.Tensor:
    half = cos_BS1R.shape[-1]
    x1, x2 = x_BSHK[..., :half], x_BSHK[..., half : 2 * half]
    out_BSHK = torch.empty_like(x_BSHK)
    torch.mul(x1, cos_BS1R, out=out_BSHK[..., :half])
    out_BSHK[..., :half].addcmul_(x2, sin_BS1R, value=-1)
    torch.mul(x2, cos_BS1R, out=out_BSHK[..., half : 2 * half])
    out_BSHK[..., half : 2 * half].addcmul_(x1, sin_BS1R)
    if 2 * half < x_BSHK.shape[-1]:
        out_BSHK[..., 2 * half :] = x_BSHK[..., 2 * half :]
    return out_BSHK


class _Rope(torch.autograd.Function):
    """RoPE as one autograd node: the backward of a rotation by angle a is the rotation of the
    gradient by -a. Written by hand because autograd through the sliced element-wise form
    allocates a zero-filled full-size gradient per slice; this halved the fwd+bwd time of the
    op on CPU (B8 S256 H6 K64)."""

    @staticmethod
    def forward(ctx, x_BSHK, cos_BS1R, sin_BS1R):
        ctx.save_for_backward(cos_BS1R, sin_BS1R)
        return _rotate(x_BSHK, cos_BS1R, sin_BS1R)

    @staticmethod
    def backward(ctx, grad_BSHK):
        cos_BS1R, sin_BS1R = ctx.saved_tensors
        return _rotate(grad_BSHK.contiguous(), cos_BS1R, -sin_BS1R), None, None


def apply_rope(
    x_BSHK: torch.Tensor, cos_BS1R: torch.Tensor, sin_BS1R: torch.Tensor
) -> torch.Tensor:
    """Rotate the first 2R dims of every head of ``x_BSHK`` (half-split pairs); keep the rest."""
    return _Rope.apply(x_BSHK, cos_BS1R, sin_BS1R)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022, §3), fp32 [H].

    For a power of two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ...; for
    other counts the n' = 2^floor(log2 n) slopes are taken and completed with every other slope
    of the 2n' sequence (the construction of the paper's reference code and of BLOOM).
    """
    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive for ALiBi, got {num_heads}")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    base = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(base)
    if base < num_heads:
        slopes += geometric(2 * base)[0::2][: num_heads - base]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(
    slopes_H: torch.Tensor, q_positions_BQ: torch.Tensor, k_positions_BK: torch.Tensor
) -> torch.Tensor:
    """Additive ALiBi bias slope_h * (k_pos - q_pos), fp32 [B, H, Q, K].

    Softmax is invariant to a per-row shift, so this equals BLOOM's slope_h * k_pos for causal
    rows while staying small for long sequences.
    """
    distance_BQK = (k_positions_BK.unsqueeze(1) - q_positions_BQ.unsqueeze(2)).float()
    return slopes_H.to(distance_BQK.device).view(1, -1, 1, 1) * distance_BQK.unsqueeze(1)
