"""The written-out causal attention of compiled low-precision CPU regions against SDPA in fp64,
and when it is (not) taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from densetrain.models.attention import (
    COMPILED_CPU_ATTENTION_MAX_SEQ,
    AttentionMask,
    scaled_dot_product,
)
from densetrain.testing import TracedOps

CAUSAL = AttentionMask(is_causal=True)


def _qkv(heads, kv_heads, seq, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, seq, 16), (2, kv_heads, seq, 16), (2, kv_heads, seq, 16)]
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


def _fp64_reference(q, k, v, grad_out):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad_out.double())
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("heads,kv_heads,dtype", [(4, 4, torch.bfloat16), (4, 2, torch.bfloat16),
                                                  (4, 1, torch.bfloat16), (4, 2, torch.float16)])
def test_compiled_bf16_attention_equals_fp64_sdpa(heads, kv_heads, dtype):
    q, k, v = _qkv(heads, kv_heads, 24, dtype)
    grad_out = torch.randn(2, heads, 24, 16).to(dtype)

    backend = TracedOps()

    @torch.compile(backend=backend, fullgraph=True)
    def attend(q, k, v):
        return scaled_dot_product(q, k, v, CAUSAL, dropout_p=0.0,
                                  enable_gqa=heads != kv_heads)

    out = attend(q, k, v)
    out.backward(grad_out)
    assert backend.names and not backend.traced("scaled_dot_product")  # the written path
    ref_out, ref_grads = _fp64_reference(q, k, v, grad_out)
    # bf16 inputs and outputs: a few units in the last of bf16's 8 significant bits
    torch.testing.assert_close(out.double(), ref_out, rtol=0.02, atol=0.02)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0.03, atol=0.03)


@pytest.mark.parametrize("case", ["fp32", "eager", "long", "masked", "dropout"])
def test_sdpa_everywhere_else(case):
    seq = COMPILED_CPU_ATTENTION_MAX_SEQ + 1 if case == "long" else 8
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, v = _qkv(2, 2, seq, dtype)
    mask = (AttentionMask(is_causal=False, mask=torch.ones(1, 1, seq, seq, dtype=torch.bool)
                          .tril()) if case == "masked" else CAUSAL)
    dropout = 0.1 if case == "dropout" else 0.0

    def attend(q, k, v):
        return scaled_dot_product(q, k, v, mask, dropout_p=dropout, enable_gqa=False)

    backend = TracedOps()
    if case == "eager":
        out = attend(q, k, v)  # eager: no dynamo graph; SDPA's backward node shows it
        assert "ScaledDotProduct" in type(out.grad_fn).__name__
    else:
        torch.compile(attend, backend=backend, fullgraph=True)(q, k, v).sum().backward()
        assert backend.traced("scaled_dot_product")
