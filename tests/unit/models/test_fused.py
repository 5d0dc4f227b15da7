"""The fused RMSNorm and SwiGLU operators against the PyTorch composites they replace: the same
bits forward and backward, and only the tensors backward reads kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from densetrain.models.fused import RMSNorm, rms_norm, swiglu

DTYPES = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.float32), (torch.float64, torch.float64)]


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_equals_torch_bit_for_bit(x_dtype, w_dtype, autocast, with_weight):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, 96, generator=gen).to(x_dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(w_dtype).requires_grad_()
    weight = w if with_weight else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = F.rms_norm(x, [96], weight, 1e-5)
        out = rms_norm(x, weight, 1e-5)
    grad = torch.randn(ref.shape, generator=gen).to(ref.dtype)
    inputs = (x, w) if with_weight else (x,)
    expected = torch.autograd.grad(ref, inputs, grad)
    got = torch.autograd.grad(out, inputs, grad)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_rms_norm_module_is_nn_rmsnorm():
    norm = RMSNorm(64, eps=1e-6)
    ref = torch.nn.RMSNorm(64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    x = torch.randn(2, 5, 64)
    assert torch.equal(norm(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_equals_silu_times_up(dtype):
    gen = torch.Generator().manual_seed(4)
    gate = torch.randn(2, 33, 64, generator=gen).to(dtype).requires_grad_()
    up = torch.randn(2, 33, 64, generator=gen).to(dtype).requires_grad_()
    ref = F.silu(gate) * up
    out = swiglu(gate, up)
    grad = torch.randn(ref.shape, generator=gen).to(dtype)
    for a, b in zip(torch.autograd.grad(out, (gate, up), grad),
                    torch.autograd.grad(ref, (gate, up), grad), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out, ref)


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


def test_rms_norm_keeps_its_input_and_rstd_only():
    x = torch.randn(4, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    kept = _saved_bytes(lambda a, b: rms_norm(a, b, 1e-5), x, w)
    # x in bf16, the weight, rstd [4, 128, 1] in fp32 (a shape count, not torch's own)
    assert kept == x.numel() * 2 + w.numel() * 4 + 4 * 128 * 4
    composite = _saved_bytes(lambda a, b: F.rms_norm(a, [256], b, 1e-5), x, w)
    assert composite > 2.5 * kept  # the fp32 upcast and product (what this operator avoids)


def test_swiglu_keeps_gate_and_up_only():
    gate = torch.randn(4, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(4, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    assert _saved_bytes(swiglu, gate, up) == 2 * gate.numel() * 2
    assert _saved_bytes(lambda g, u: F.silu(g) * u, gate, up) == 3 * gate.numel() * 2
