"""Multi-head attention with grouped key/value heads, optional QK-norm, RoPE and masks.

The common path (causal, no document mask, no ALiBi, window not shorter than the sequence) calls
``scaled_dot_product_attention(is_causal=True)`` and never builds an S×S mask. Sliding windows
shorter than the sequence, document masks, ALiBi and KV-cache decoding pass an explicit mask
built by `densetrain.models.masks.build_attention_mask`.

Shape legend: B batch, S (or Q) query positions, T (or K) key positions, D dim, H heads,
G kv heads, K head_dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from densetrain.models.config import ModelConfig
from densetrain.models.linear import Linear
from densetrain.models.masks import AttentionMask
from densetrain.models.norms import build_head_norm
from densetrain.models.positions import apply_rope
from densetrain.models.relative import RelativePositionXL


class AttentionFn(Protocol):
    """The attention kernel of an `Attention` module, its public strategy point.

    ``attention_fn(q_BHSK, k_BGTK, v_BGTK, mask, *, dropout_p, enable_gqa) -> out_BHSK``. The
    default is `scaled_dot_product`; parallel layouts that change how attention sees the
    sequence (context parallel) set their own function on each module's ``attention_fn``.
    """

    def __call__(
        self,
        q_BHSK: torch.Tensor,
        k_BGTK: torch.Tensor,
        v_BGTK: torch.Tensor,
        mask: AttentionMask,
        *,
        dropout_p: float,
        enable_gqa: bool,
    ) -> torch.Tensor: ...


def scaled_dot_product(
    q_BHSK: torch.Tensor,
    k_BGTK: torch.Tensor,
    v_BGTK: torch.Tensor,
    mask: AttentionMask,
    *,
    dropout_p: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """The default `AttentionFn`: torch's fused SDPA, causal without a mask tensor when it can.

    ``enable_gqa`` measured about 1.2x faster than expanding the kv heads with repeat_interleave
    on CPU (fwd+bwd; bench_model.py --gqa, benchmarks/RESULTS.md). Short causal sequences in
    low precision inside a compiled CPU region take `_compiled_cpu_attention` instead.
    """
    if _compiled_cpu_attention_applies(q_BHSK, k_BGTK, mask, dropout_p):
        return _compiled_cpu_attention(q_BHSK, k_BGTK, v_BGTK)
    return F.scaled_dot_product_attention(
        q_BHSK,
        k_BGTK,
        v_BGTK,
        attn_mask=mask.mask,
        is_causal=mask.is_causal,
        dropout_p=dropout_p,
        enable_gqa=enable_gqa,
    )


COMPILED_CPU_ATTENTION_MAX_SEQ = 512
"""Longest sequence (queries and keys) that `_compiled_cpu_attention` takes. A memory bound,
not a speed one: it is also faster than SDPA at 1,024 and 2,048 positions (1.4× on 2 AMD EPYC
Zen 5 cores, benchmarks/bench_attention.py), but it holds [B, H, S, S] bf16 probabilities per
layer for backward (at 1,024 positions, batch 8 and 12 heads, 200 MB a layer) where SDPA's
flash kernel holds O(S)."""


def _compiled_cpu_attention_applies(q_BHSK: torch.Tensor, k_BGTK: torch.Tensor,
                                    mask: AttentionMask, dropout_p: float) -> bool:
    return (
        q_BHSK.device.type == "cpu"
        and q_BHSK.dtype in (torch.bfloat16, torch.float16)
        and torch.compiler.is_compiling()
        and mask.is_causal and mask.mask is None and dropout_p == 0.0
        and q_BHSK.shape[-2] == k_BGTK.shape[-2] <= COMPILED_CPU_ATTENTION_MAX_SEQ
        and type(q_BHSK) is torch.Tensor  # not a DTensor / tensor subclass
    )


def _compiled_cpu_attention(q_BHSK: torch.Tensor, k_BGTK: torch.Tensor,
                            v_BGTK: torch.Tensor) -> torch.Tensor:
    """Causal attention written out — scores, fp32 softmax, weighted values — for inductor to
    fuse on the CPU (`_WrittenOutAttention` has the forward and the backward).

    PyTorch's CPU flash-attention kernel reaches about 0.1 TFLOP/s in bf16, a fifth of the bf16
    matmul rate, and for a short sequence its blocking buys nothing: the [S, S] scores of a
    head fit in cache. Written out, the products are bf16 matmuls (oneDNN) and inductor fuses
    scale, mask, softmax and the casts into one loop each way. Measured on 2 AMD EPYC Zen 5
    cores, bf16, [8, 6, 256, 64] causal, forward + backward: 2.7× SDPA (2.3× at 512 positions;
    benchmarks/bench_attention.py, benchmarks/RESULTS.md). It holds the [B, H, S, S]
    probabilities for backward (6 MB a layer there), so it is taken up to
    ``COMPILED_CPU_ATTENTION_MAX_SEQ``.
    """
    batch, heads, seq, head_dim = q_BHSK.shape
    out_BGRSK = _WrittenOutAttention.apply(
        q_BHSK.view(batch, k_BGTK.shape[1], heads // k_BGTK.shape[1], seq, head_dim),
        k_BGTK, v_BGTK,
    )
    return out_BGRSK.view(batch, heads, seq, head_dim)


def _causal_ST(seq: int, device: torch.device) -> torch.Tensor:
    # From index comparisons, not a stored tril: inductor computes it inside the softmax loop
    # (in int32, a quarter faster there than int64; measured beside a bool tril, an additive
    # bias and exp(s - logsumexp(s)), which were slower).
    index = torch.arange(seq, dtype=torch.int32, device=device)
    return index[:, None] >= index[None, :]


class _WrittenOutAttention(torch.autograd.Function):
    """Causal attention of ``q`` [B, G, R, S, K] (R query heads per kv head) over ``k``, ``v``
    [B, G, T, K] with its own backward.

    Written by hand because autograd's backward of the fp32 softmax needs the fp32
    probabilities, which inductor then either stores ([B, H, S, S] fp32) or recomputes in a
    second pass over the scores: both cost more than the products. This backward uses the
    low-precision probabilities P that the value product saves anyway: dS = P ∘ (dP −
    rowsum(dP ∘ P)), one fused row loop in fp32. (Flash attention's rowsum(dO ∘ O) would need
    the output saved as well; measured the same speed, and less accurate against fp64 here.)
    The R query heads of a kv head are one [R·S] row block of each product, so grouped heads
    need no expanded keys or values and their key and value gradients are summed by the
    matmuls themselves. Forward + backward of [8, 6, 256, 64] bf16 on 2 AMD EPYC Zen 5 cores:
    6.0 ms against 12.5 ms for the same code through autograd (benchmarks/RESULTS.md).
    """

    @staticmethod
    def forward(ctx, q_BGRSK, k_BGTK, v_BGTK):
        batch, groups, reps, seq, head_dim = q_BGRSK.shape
        q_BGNK = q_BGRSK.reshape(batch, groups, reps * seq, head_dim)  # N = R·S
        scores_BGRST = (q_BGNK @ k_BGTK.transpose(-1, -2)).view(*q_BGRSK.shape[:-1], seq)
        scores_BGRST = torch.where(_causal_ST(seq, q_BGRSK.device),
                                   scores_BGRST.float() * head_dim**-0.5, float("-inf"))
        probs_BGNT = torch.softmax(scores_BGRST, dim=-1).to(q_BGRSK.dtype).view(
            batch, groups, reps * seq, seq)
        out_BGNK = probs_BGNT @ v_BGTK
        ctx.save_for_backward(q_BGNK, k_BGTK, v_BGTK, probs_BGNT)
        return out_BGNK.view(q_BGRSK.shape)

    @staticmethod
    def backward(ctx, grad_BGRSK):
        q_BGNK, k_BGTK, v_BGTK, probs_BGNT = ctx.saved_tensors
        grad_BGNK = grad_BGRSK.reshape(q_BGNK.shape)
        grad_v_BGTK = probs_BGNT.transpose(-1, -2) @ grad_BGNK
        grad_probs_BGNT = grad_BGNK @ v_BGTK.transpose(-1, -2)
        probs_f_BGNT, grad_probs_f_BGNT = probs_BGNT.float(), grad_probs_BGNT.float()
        row_BGN1 = (grad_probs_f_BGNT * probs_f_BGNT).sum(-1, keepdim=True)
        grad_scores_BGNT = (
            probs_f_BGNT * (grad_probs_f_BGNT - row_BGN1) * q_BGNK.shape[-1] ** -0.5
        ).to(q_BGNK.dtype)
        grad_q_BGNK = grad_scores_BGNT @ k_BGTK
        grad_k_BGTK = grad_scores_BGNT.transpose(-1, -2) @ q_BGNK
        return grad_q_BGNK.view(grad_BGRSK.shape), grad_k_BGTK, grad_v_BGTK


class LayerCache(Protocol):
    """Per-layer key/value store used during generation (see ``densetrain.generate``)."""

    def update(
        self, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values; return the keys/values to attend over ([B, G, T, K])."""
        ...


class Attention(nn.Module):
    """Causal self-attention: MHA (G = H), GQA (1 < G < H) or MQA (G = 1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        qkv_bias = config.qkv_bias
        self.wq = Linear(config.dim, config.q_dim, bias=qkv_bias)
        self.wk = Linear(config.dim, config.kv_dim, bias=qkv_bias)
        self.wv = Linear(config.dim, config.kv_dim, bias=qkv_bias)
        self.wo = Linear(config.q_dim, config.dim, bias=config.attn_out_bias)
        self.q_norm = build_head_norm(config) if config.qk_norm else None
        self.k_norm = build_head_norm(config) if config.qk_norm else None
        relative = config.position_embedding == "relative_xl"
        self.relative = RelativePositionXL(config) if relative else None
        self.attention_fn: AttentionFn = self.relative.attend if relative else scaled_dot_product
        """The attention kernel (see `AttentionFn`); ``densetrain.parallel`` may replace it."""
        self.head_start = 0
        """The model's index of this module's first query head: tensor parallel leaves each rank
        ``num_heads`` of them and sets it, so a per-head mask (ALiBi) is sliced to the rank's
        heads."""

    def forward(
        self,
        x_BSD: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask,
        kv_cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Attend over ``x_BSD`` (plus cached keys); ``rope`` is (cos, sin) from
        ``positions.rope_cos_sin`` or None. Returns [B, S, D]."""
        batch, seq, _ = x_BSD.shape
        q_BSHK = self.wq(x_BSD).view(batch, seq, self.num_heads, self.head_dim)
        k_BSGK = self.wk(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim)
        v_BSGK = self.wv(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BSHK = self.q_norm(q_BSHK)
            k_BSGK = self.k_norm(k_BSGK)
        if rope is not None:
            q_BSHK = apply_rope(q_BSHK, *rope)
            k_BSGK = apply_rope(k_BSGK, *rope)
        q_BHSK = q_BSHK.transpose(1, 2)
        k_BGTK = k_BSGK.transpose(1, 2)
        v_BGTK = v_BSGK.transpose(1, 2)
        if kv_cache is not None:
            k_BGTK, v_BGTK = kv_cache.update(k_BGTK, v_BGTK)
        if mask.mask is not None and mask.mask.shape[1] > self.num_heads:
            mask = mask.for_heads(self.head_start, self.num_heads)
        out_BHSK = self.attention_fn(
            q_BHSK, k_BGTK, v_BGTK, mask,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        out_BSD = out_BHSK.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.wo(out_BSD)
