"""GELU's tanh approximation as compiled CPU regions compute it (the sigmoid form) against
``F.gelu(approximate="tanh")`` in fp64, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from densetrain.models.mlp import gelu_tanh
from densetrain.testing import TracedOps


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_compiled_gelu_tanh_equals_fp64_reference(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=gen) * 4).to(dtype).requires_grad_(True)
    grad_out = torch.randn(4, 64, generator=gen).to(dtype)
    backend = TracedOps()
    out = torch.compile(gelu_tanh, backend=backend, fullgraph=True)(x)
    out.backward(grad_out)
    assert backend.traced("sigmoid") and not backend.traced("gelu")  # the compiled form

    x64 = x.detach().double().requires_grad_(True)
    want = F.gelu(x64, approximate="tanh")
    want.backward(grad_out.double())
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)


def test_eager_gelu_tanh_is_aten_kernel():
    x = torch.randn(8, requires_grad=True)
    out = gelu_tanh(x)
    assert "Gelu" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), rtol=0, atol=0)
