"""The oneDNN-routed fp32 CPU linear against ``F.linear`` in fp64, and when it is (not) taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import densetrain.models.linear as linear_module
from densetrain.models.linear import (
    ONEDNN_AVX2_MAX_REDUCTION,
    Linear,
    linear,
    matmul,
    onednn_reduction_limit,
    transposed_copy,
    uses_onednn,
)
from densetrain.testing import OpNames

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.fixture(params=[ONEDNN_AVX2_MAX_REDUCTION, None, 0],
                ids=["limit768", "unbounded", "mkl-only"])
def reduction_limit(request, monkeypatch):
    """The three routing policies on any CPU: the AVX2 limit, AVX-512 AMD's none (all
    oneDNN) and AVX-512 Intel's 0 (all MKL)."""
    monkeypatch.setattr(linear_module, "ONEDNN_MAX_REDUCTION", request.param)
    return request.param


def _short(reduction, limit):
    return limit is None or reduction <= limit


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_out", [(48, 80), (80, 48), (64, 1000), (1000, 64)])
@pytest.mark.parametrize("tokens", [(3, 5), (2, 400)])
def test_linear_equals_fp64_reference_in_values_and_gradients(bias, in_out, tokens,
                                                              reduction_limit):
    fan_in, fan_out = in_out
    torch.manual_seed(0)
    layer = Linear(fan_in, fan_out, bias=bias)
    x = torch.randn(*tokens, fan_in, requires_grad=True)
    grad_out = torch.randn(*tokens, fan_out)
    with OpNames() as ops:
        y = layer(x)
        y.backward(grad_out)
    # forward on oneDNN for a short in-features reduction; then each gradient for its own
    # (input gradient: out-features; weight gradient: tokens)
    expected = 0
    if _short(fan_in, reduction_limit):
        expected = 1 + _short(fan_out, reduction_limit) + _short(x[..., 0].numel(),
                                                                 reduction_limit)
    assert ops.names.count("mkldnn._linear_pointwise") == expected
    x64 = x.detach().double().requires_grad_(True)
    w64 = layer.weight.detach().double().requires_grad_(True)
    b64 = layer.bias.detach().double().requires_grad_(True) if bias else None
    ref = F.linear(x64, w64, b64)
    ref.backward(grad_out.double())

    def close(actual, expected, reduction):  # fp32 rounding grows like sqrt(reduction)
        atol = 4e-6 * max(reduction, 16) ** 0.5
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=atol)

    tokens_n = x[..., 0].numel()
    close(y, ref, fan_in)
    close(x.grad, x64.grad, fan_out)
    close(layer.weight.grad, w64.grad, tokens_n)
    if bias:
        close(layer.bias.grad, b64.grad, tokens_n)


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (40, 33), (96, 64)])
@pytest.mark.parametrize("tile", [(8, 16), (5, 3), (512, 1024)])
def test_transposed_copy_is_the_transpose_in_every_tile(shape, tile, monkeypatch):
    """Tiles that divide the shape, that leave ragged edges and that cover it whole."""
    monkeypatch.setattr(linear_module, "TRANSPOSE_TILE", tile)
    src = torch.randn(*shape)
    out = transposed_copy(src)
    assert out.is_contiguous() and torch.equal(out, src.t())
    target = torch.full((shape[1] + 2, shape[0]), float("nan"))
    written = transposed_copy(src, target[1:-1])
    assert written.data_ptr() == target[1].data_ptr() and torch.equal(target[1:-1], src.t())
    assert target[0].isnan().all() and target[-1].isnan().all()  # nothing outside out_CR


def test_weight_gradient_takes_the_cheaper_transpose_and_is_contiguous(monkeypatch):
    """Many out-features (N·I + I·O < N·O): the weight gradient is (xᵀ @ g)ᵀ, and it equals
    gᵀ @ x in fp64, contiguous like the weight."""
    monkeypatch.setattr(linear_module, "ONEDNN_MAX_REDUCTION", None)
    copies = []
    real_copy = linear_module.transposed_copy

    def counting_copy(src, out=None):
        copies.append(tuple(src.shape))
        return real_copy(src, out)

    monkeypatch.setattr(linear_module, "transposed_copy", counting_copy)
    torch.manual_seed(0)
    for fan_in, fan_out, expected in ((16, 200, [(300, 16), (16, 200)]), (200, 16, [(300, 16)])):
        copies.clear()
        layer = Linear(fan_in, fan_out, bias=False)
        x = torch.randn(300, fan_in)
        grad_out = torch.randn(300, fan_out)
        layer(x).backward(grad_out)
        assert copies == expected  # xᵀ and the product back, or gᵀ alone
        assert layer.weight.grad.is_contiguous()
        torch.testing.assert_close(layer.weight.grad.double(),
                                   grad_out.double().t() @ x.double(), rtol=1e-5, atol=1e-4)


def test_linear_is_an_nn_linear_with_the_same_state_dict():
    layer = Linear(8, 4)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == set(nn.Linear(8, 4).state_dict())


def test_the_routing_policy_per_cpu():
    """MKL runs AVX2 code on AVX-512 CPUs of other vendors (AMD Zen 4 / 5): every reduction
    goes to oneDNN there; none on Intel's AVX-512 CPUs (MKL native); elsewhere the short ones."""
    assert onednn_reduction_limit("AuthenticAMD", "AVX512") is None
    assert onednn_reduction_limit("AuthenticAMD", "AVX2") == ONEDNN_AVX2_MAX_REDUCTION
    assert onednn_reduction_limit("GenuineIntel", "AVX512") == 0
    assert onednn_reduction_limit("GenuineIntel", "AVX2") == ONEDNN_AVX2_MAX_REDUCTION
    assert onednn_reduction_limit("", "AVX512") == ONEDNN_AVX2_MAX_REDUCTION  # unknown vendor
    assert onednn_reduction_limit("AuthenticAMD", "DEFAULT") == ONEDNN_AVX2_MAX_REDUCTION


def test_matmul_equals_fp64_and_follows_the_rule(reduction_limit):
    torch.manual_seed(3)
    for m, k, n in [(7, 30, 11), (5, 1000, 9)]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for a_in, b_in in [(a, b), (a.t().contiguous().t(), b.t().contiguous().t())]:
            with OpNames() as ops:
                out = matmul(a_in, b_in)
            assert ("mkldnn._linear_pointwise" in ops.names) == _short(k, reduction_limit)
            torch.testing.assert_close(out.double(), a.double() @ b.double(),
                                       rtol=1e-5, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16), OpNames() as ops:
        matmul(torch.randn(4, 8), torch.randn(8, 4))
    assert "mkldnn._linear_pointwise" not in ops.names


def test_other_dtypes_autocast_compile_and_long_reductions_keep_f_linear(reduction_limit):
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    assert uses_onednn(x, w) == (reduction_limit != 0)
    assert not uses_onednn(x.double(), w.double())
    assert not uses_onednn(x.to("meta"), w.to("meta"))  # any other device: CUDA's own GEMMs
    assert Linear(16, 8, device="meta")(x.to("meta")).device.type == "meta"
    long_k = ONEDNN_AVX2_MAX_REDUCTION + 1
    long_x, long_w = torch.randn(4, long_k), torch.randn(8, long_k)
    assert uses_onednn(long_x, long_w) == (reduction_limit is None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(x, w)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(a, b):
        seen.append(uses_onednn(a, b))
        return linear(a, b)

    torch.testing.assert_close(compiled(x, w), F.linear(x, w))
    assert seen == [False]


def test_flop_counter_counts_the_onednn_matmuls_like_aten_ones():
    torch.manual_seed(1)
    fast, plain = Linear(32, 24), nn.Linear(32, 24)
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(2, 7, 32, requires_grad=True)
    counts = []
    for layer in (fast, plain):
        with FlopCounterMode(display=False) as counter:
            layer(x).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * 14 * 32 * 24


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointed_blocks_recompute_what_aten_matmuls_would(mode, monkeypatch):
    """Selective checkpointing saves the oneDNN matmuls like aten ones (no matmul recomputed);
    full checkpointing runs aten matmuls, so torch's early stop still skips the block's last
    matmul: the FLOP counts equal those of the same model with every linear on aten."""
    from densetrain.models import ModelConfig, Transformer

    # the AVX2 policy on any CPU: this model's short reductions go to oneDNN
    monkeypatch.setattr(linear_module, "ONEDNN_MAX_REDUCTION", ONEDNN_AVX2_MAX_REDUCTION)
    from densetrain.parallel.checkpointing import apply_activation_checkpointing

    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=64,
                      max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def counted(onednn: bool):
        model = Transformer(cfg)
        model.init_weights(seed=0)
        apply_activation_checkpointing(model, mode)
        with FlopCounterMode(display=False) as counter, OpNames() as ops:
            if onednn:
                model(tokens).square().mean().backward()
            else:
                with linear_module.aten_matmuls():
                    model(tokens).square().mean().backward()
        return counter.get_total_flops(), "mkldnn._linear_pointwise" in ops.names

    fast, used = counted(True)
    reference, unused = counted(False)
    assert fast == reference
    assert used and not unused  # the fast path ran (the output head at least); aten only


class _GraphOps:
    """A torch.compile backend that keeps the op names of the forward and backward graphs
    (through AOTAutograd) and runs them as they are."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.names = []

        def record(graph_module, example_inputs):
            self.names += [str(n.target) for n in graph_module.graph.nodes
                           if n.op == "call_function"]
            return graph_module.forward

        self.backend = aot_autograd(fw_compiler=record, bw_compiler=record)

    def count(self, fragment):
        return sum(fragment in name for name in self.names)


@pytest.mark.parametrize("in_out", [(48, 80), (1000, 64)])
def test_compiled_linear_keeps_onednn_and_equals_fp64(in_out, reduction_limit):
    """Inside torch.compile a plain fp32 CPU linear runs its matmuls through the
    ``densetrain::onednn_mm`` custom op where the rule says (inductor would pick MKL), its
    backward too; values and gradients equal the fp64 reference."""
    torch._dynamo.reset()
    fan_in, fan_out = in_out
    torch.manual_seed(0)
    layer = Linear(fan_in, fan_out)
    x = torch.randn(4, 50, fan_in, requires_grad=True)
    grad_out = torch.randn(4, 50, fan_out)
    graphs = _GraphOps()
    y = torch.compile(layer, backend=graphs.backend)(x)
    y.backward(grad_out)
    # forward; input gradient (reduction fan_out); weight gradient (reduction: 200 tokens)
    expected = 0
    if _short(fan_in, reduction_limit):
        expected = 1 + _short(fan_out, reduction_limit) + _short(200, reduction_limit)
    assert graphs.count("densetrain.onednn_mm") == expected
    x64 = x.detach().double().requires_grad_(True)
    w64 = layer.weight.detach().double().requires_grad_(True)
    b64 = layer.bias.detach().double().requires_grad_(True)
    F.linear(x64, w64, b64).backward(grad_out.double())
    atol = 4e-6 * max(fan_in, fan_out, 200) ** 0.5
    torch.testing.assert_close(y.double(), F.linear(x64, w64, b64).detach(), rtol=1e-5,
                               atol=atol)
    for got, want in [(x.grad, x64.grad), (layer.weight.grad, w64.grad),
                      (layer.bias.grad, b64.grad)]:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=atol)
    torch._dynamo.reset()


def test_compiled_linear_under_autocast_and_the_flop_count():
    torch._dynamo.reset()
    layer = Linear(32, 16)
    x = torch.randn(3, 32)
    graphs = _GraphOps()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(layer, backend=graphs.backend)(x)
    assert graphs.count("densetrain.onednn_mm") == 0  # bf16: PyTorch's own oneDNN matmuls
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with FlopCounterMode(display=False) as counter:
        torch.ops.densetrain.onednn_mm(a, b)
    assert counter.get_total_flops() == 2 * 5 * 7 * 3
    torch._dynamo.reset()
