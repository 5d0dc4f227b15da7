"""The oneDNN-routed fp32 CPU linear against ``F.linear`` in fp64, and when it is (not) taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from densetrain.models.linear import ONEDNN_MAX_REDUCTION, Linear, linear, uses_onednn

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_out", [(48, 80), (80, 48), (64, 1000), (1000, 64)])
def test_linear_equals_fp64_reference_in_values_and_gradients(bias, in_out):
    fan_in, fan_out = in_out
    torch.manual_seed(0)
    layer = Linear(fan_in, fan_out, bias=bias)
    x = torch.randn(3, 5, fan_in, requires_grad=True)
    grad_out = torch.randn(3, 5, fan_out)
    with _Ops() as ops:
        y = layer(x)
    y.backward(grad_out)
    onednn = fan_in <= ONEDNN_MAX_REDUCTION
    assert ("mkldnn._linear_pointwise" in ops.names) == onednn
    x64 = x.detach().double().requires_grad_(True)
    w64 = layer.weight.detach().double().requires_grad_(True)
    b64 = layer.bias.detach().double().requires_grad_(True) if bias else None
    ref = F.linear(x64, w64, b64)
    ref.backward(grad_out.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


def test_linear_is_an_nn_linear_with_the_same_state_dict():
    layer = Linear(8, 4)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == set(nn.Linear(8, 4).state_dict())


def test_other_dtypes_autocast_compile_and_long_reductions_keep_f_linear():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    assert uses_onednn(x, w)
    assert not uses_onednn(x.double(), w.double())
    assert not uses_onednn(x.to("meta"), w.to("meta"))  # any other device: CUDA's own GEMMs
    assert Linear(16, 8, device="meta")(x.to("meta")).device.type == "meta"
    assert not uses_onednn(torch.randn(4, ONEDNN_MAX_REDUCTION + 1),
                           torch.randn(8, ONEDNN_MAX_REDUCTION + 1))
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
def test_checkpointed_blocks_recompute_what_aten_matmuls_would(mode):
    """Selective checkpointing saves the oneDNN matmuls like aten ones (no matmul recomputed);
    full checkpointing runs aten matmuls, so torch's early stop still skips the block's last
    matmul: the FLOP counts equal those of the same model with every linear on aten."""
    import densetrain.models.linear as linear_module
    from densetrain.models import ModelConfig, Transformer
    from densetrain.parallel.checkpointing import apply_activation_checkpointing

    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=64,
                      max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def counted(onednn: bool):
        model = Transformer(cfg)
        model.init_weights(seed=0)
        apply_activation_checkpointing(model, mode)
        with FlopCounterMode(display=False) as counter, _Ops() as ops:
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
