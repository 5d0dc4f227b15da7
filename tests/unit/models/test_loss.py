"""Losses against PyTorch's own cross-entropy and the PaLM z-loss formula written out."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import densetrain.models.loss as loss_module
from densetrain.models.loss import chunked_lm_loss, cross_entropy_loss
from densetrain.testing import OpNames


@pytest.fixture(params=[False, True], ids=["VE-head", "EV-head"])
def head_layout(request, monkeypatch):
    """Both low-precision CPU head layouts on any CPU: the [V, E] weight with one input-gradient
    product, and AMX's contiguous [E, V] copy (`TRANSPOSED_LOW_PRECISION_HEAD`) with the input
    gradient summed over blocks of vocab rows; blocks small enough here that the small
    vocabularies of these tests span several."""
    monkeypatch.setattr(loss_module, "TRANSPOSED_LOW_PRECISION_HEAD", request.param)
    monkeypatch.setattr(loss_module, "DX_BLOCK", 40)
    monkeypatch.setattr(loss_module, "TRANSPOSE_ROWS", 24)
    return request.param


def _data(vocab=50, tokens=(3, 7), ignore_every=4):
    torch.manual_seed(0)
    logits = torch.randn(*tokens, vocab) * 3
    targets = torch.randint(0, vocab, tokens)
    targets.view(-1)[::ignore_every] = -100
    return logits, targets


def test_cross_entropy_matches_torch_with_ignore_index():
    logits, targets = _data()
    out = cross_entropy_loss(logits, targets)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert out.num_tokens.item() == (targets != -100).sum().item()
    assert out.z_loss.item() == 0.0


def test_z_loss_is_coef_times_mean_squared_logsumexp():
    logits, targets = _data()
    out = cross_entropy_loss(logits, targets, z_loss_coef=1e-4)
    valid = targets != -100
    lse = torch.log(torch.exp(logits.double()).sum(-1))[valid]
    torch.testing.assert_close(out.z_loss.double(), 1e-4 * (lse**2).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss, out.ce_loss + out.z_loss)


def test_bf16_logits_are_upcast():
    logits, targets = _data()
    low = logits.to(torch.bfloat16)
    out = cross_entropy_loss(low, targets)
    assert out.loss.dtype == torch.float32
    expected = F.cross_entropy(low.float().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(out.loss, expected)


def test_all_ignored_gives_zero_not_nan():
    logits, _ = _data()
    out = cross_entropy_loss(logits, torch.full(logits.shape[:2], -100))
    assert out.loss.item() == 0.0 and out.num_tokens.item() == 0


@pytest.mark.parametrize("chunk_size", [1, 5, 21, 64])
@pytest.mark.parametrize("z_loss_coef", [0.0, 1e-3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_equals_unchunked_values_and_gradients(chunk_size, z_loss_coef, with_bias):
    torch.manual_seed(1)
    vocab, padded, width = 37, 48, 16
    hidden = torch.randn(3, 7, width, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(padded, width, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(padded, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (3, 7))
    targets[0, :3] = -100
    reference = cross_entropy_loss(
        F.linear(hidden, weight, bias)[..., :vocab], targets, z_loss_coef=z_loss_coef
    )
    ref_grads = torch.autograd.grad(
        reference.loss * 2.5, [hidden, weight] + ([bias] if bias is not None else [])
    )
    chunked = chunked_lm_loss(
        hidden,
        weight,
        targets,
        vocab_size=vocab,
        chunk_size=chunk_size,
        z_loss_coef=z_loss_coef,
        output_bias_P=bias,
    )
    grads = torch.autograd.grad(
        chunked.loss * 2.5, [hidden, weight] + ([bias] if bias is not None else [])
    )
    torch.testing.assert_close(chunked.loss.double(), reference.loss.double())
    torch.testing.assert_close(chunked.z_loss.double(), reference.z_loss.double())
    assert chunked.num_tokens.item() == reference.num_tokens.item()
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)  # both in fp32
    assert torch.count_nonzero(grads[1][vocab:]) == 0  # padding rows never receive gradient


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
@pytest.mark.parametrize("limit", [768, None], ids=["limit768", "unbounded"])
@pytest.mark.parametrize("chunk_size", [5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_fp32_gradients_on_either_matmul_library(limit, chunk_size, with_bias,
                                                          monkeypatch):
    """fp32 on the CPU: the gradient matmuls run on oneDNN where `linear.py`'s rule says (all
    of them on AVX-512 AMD CPUs, the weight gradient as hᵀ @ p summed in [E, V]) or on aten;
    either way the values and gradients equal the fp64 reference."""
    import densetrain.models.linear as linear_module

    monkeypatch.setattr(linear_module, "ONEDNN_MAX_REDUCTION", limit)
    torch.manual_seed(2)
    vocab, padded, width = 900, 912, 24
    hidden64 = torch.randn(2, 40, width, dtype=torch.float64)
    weight64 = torch.randn(padded, width, dtype=torch.float64) / 3
    bias64 = torch.randn(padded, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, vocab, (2, 40))
    targets[1, :7] = -100
    leaves64 = [t.requires_grad_(True) for t in (hidden64, weight64, bias64) if t is not None]
    # the fp64 reference written out: mean CE over counted tokens + 1e-3 · mean(log²Z)
    logits64 = F.linear(hidden64, weight64, bias64)[..., :vocab].reshape(-1, vocab)
    valid = targets.reshape(-1) != -100
    lse = torch.logsumexp(logits64, dim=-1)[valid]
    target_logit = logits64[valid].gather(1, targets.reshape(-1)[valid].unsqueeze(1)).squeeze(1)
    reference = (lse - target_logit).mean() + 1e-3 * lse.square().mean()
    ref_grads = torch.autograd.grad(reference * 1.5, leaves64)
    leaves = [t.detach().float().requires_grad_(True) for t in leaves64]
    bias = leaves[2] if with_bias else None
    with OpNames() as ops:
        chunked = chunked_lm_loss(leaves[0], leaves[1], targets, vocab_size=vocab,
                                  chunk_size=chunk_size, z_loss_coef=1e-3, output_bias_P=bias)
        grads = torch.autograd.grad(chunked.loss * 1.5, leaves)
    # forward logits (reduction 24) on oneDNN under both rules; the input gradient (reduction
    # 900) and the weight gradient (reduction: the chunk) only where the rule allows them
    onednn_calls = ops.names.count("mkldnn._linear_pointwise")
    chunks = -(-80 // chunk_size)
    expected = chunks * (1 + (limit is None) + (limit is None or chunk_size <= limit))
    assert onednn_calls == expected
    torch.testing.assert_close(chunked.loss.double(), reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    assert torch.count_nonzero(grads[1][vocab:]) == 0


def test_chunked_without_grad_and_bad_chunk_size():
    hidden, weight = torch.randn(2, 3, 8), torch.randn(10, 8)
    targets = torch.randint(0, 10, (2, 3))
    with torch.no_grad():
        out = chunked_lm_loss(hidden, weight, targets, vocab_size=10, chunk_size=4)
    expected = cross_entropy_loss(F.linear(hidden, weight), targets)
    torch.testing.assert_close(out.loss, expected.loss)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_lm_loss(hidden, weight, targets, vocab_size=10, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_size"):
        chunked_lm_loss(hidden, weight, targets, vocab_size=11, chunk_size=4)


def test_chunked_under_bf16_autocast_runs_its_matmuls_in_bf16(head_layout):
    """Under autocast the three matmuls of every chunk (logits, grad of hidden, grad of weight;
    the grad of hidden in three blocks of vocab rows on the [E, V] head) run in bf16 and the
    gradients match autocast's own linear + cross-entropy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                       torch.ops.aten.addmm_):
                self.seen.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
            return func(*args, **(kwargs or {}))

    torch.manual_seed(2)
    vocab, width = 96, 32
    hidden = torch.randn(2, 40, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = cross_entropy_loss(F.linear(hidden, weight), targets)
    ref_grads = torch.autograd.grad(reference.loss, [hidden, weight])
    mode = MatmulDtypes()
    with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        chunked = chunked_lm_loss(hidden, weight, targets, vocab_size=vocab, chunk_size=32)
    grads = torch.autograd.grad(chunked.loss, [hidden, weight])
    per_chunk = 2 + (3 if head_layout else 1)  # vocab 96 in blocks of 40 rows: 3 products
    assert len(mode.seen) == 3 * per_chunk  # 80 tokens in chunks of 32: three chunks
    assert all(dtypes == {torch.bfloat16} for dtypes in mode.seen), mode.seen
    torch.testing.assert_close(chunked.loss, reference.loss, rtol=1e-3, atol=1e-3)
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.float32
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_compiled_chunk_kernel_equals_eager_under_autocast(head_layout):
    """With bf16 logits the torch.compile'd per-chunk kernel gives the eager kernel's loss, and
    its gradients to bf16 rounding (it rounds the unnormalised exponentials, the eager kernel
    the probabilities): both against the fp32 loss (fp32 logits always take the eager
    kernel)."""
    torch.manual_seed(3)
    vocab, width = 64, 16
    hidden = torch.randn(2, 24, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (2, 24))
    targets[1, :5] = -100
    results = []
    for compiled in (False, True, None):  # eager bf16, compiled bf16, fp32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compiled is not None):
            out = chunked_lm_loss(hidden, weight, targets, vocab_size=vocab, chunk_size=16,
                                  z_loss_coef=1e-3, compiled=bool(compiled))
        results.append((out.loss, *torch.autograd.grad(out.loss, [hidden, weight])))
    eager, fused, fp32 = results
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-6, atol=1e-6)
    for got, want, exact in zip(fused[1:], eager[1:], fp32[1:], strict=True):
        scale = exact.abs().max()
        # measured: 3e-3 (fused vs eager), 1.0e-2 and 1.0e-2 (each against fp32) of the
        # largest entry
        assert (got - want).abs().max() <= 2**-7 * scale
        assert (got - exact).abs().max() <= 2e-2 * scale
        assert (want - exact).abs().max() <= 2e-2 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_chunk_kernels_give_logsumexp_and_softmax(dtype):
    """Each kernel's log Z, target logit and probabilities against torch's fp64 logsumexp and
    softmax, including a row whose target probability underflows in fp32."""
    from densetrain.models.loss import (
        _exact_softmax_and_lse,
        _softmax_and_lse,
        compiled_chunk_kernel,
    )

    torch.manual_seed(5)
    logits = (torch.randn(6, 300) * 4).to(dtype)
    targets = torch.randint(0, 300, (6,))
    logits[3] = 100.0
    logits[3, targets[3]] = -100.0
    exact = logits.double()
    rebuilt = []

    def row_logits(rows):  # what the chunked loss passes: those rows' logits, recomputed
        rebuilt.append(int(rows.sum()))
        return logits[rows]

    kernels = {
        "eager": functools.partial(_softmax_and_lse, row_logits=row_logits),
        "exact": _exact_softmax_and_lse,
        "compiled": compiled_chunk_kernel(),
    }
    for name, kernel in kernels.items():
        given = logits.clone()
        lse, logit_t, probs, *factor = kernel(given, targets, True)
        written = probs
        if factor:  # the compiled kernel's unnormalised exponentials and their row factor
            probs = probs.double() * factor[0].double().unsqueeze(1)
        torch.testing.assert_close(lse.double(), exact.logsumexp(-1), rtol=1e-6, atol=1e-5,
                                   msg=name)
        torch.testing.assert_close(logit_t.double(), exact[torch.arange(6), targets], msg=name)
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(probs.double(), exact.softmax(-1), rtol=tol, atol=tol,
                                   msg=name)
        # fp32 logits are overwritten by the probabilities (the eager kernel rebuilds rows it
        # needs again; the exact one, compiled or not, never needs them); bf16 ones are left,
        # except by the compiled kernel, which writes the bf16 probabilities over them.
        overwrites = dtype == torch.float32 or name == "compiled"
        assert (written.data_ptr() == given.data_ptr()) == overwrites, name
        if not overwrites:
            assert torch.equal(given, logits), name
        lse_eval, _, *nones = kernel(logits.clone(), targets, False)
        assert all(none is None for none in nones)
        torch.testing.assert_close(lse_eval, lse, rtol=1e-6, atol=1e-5)
    # with row_logits the softmax never keeps the logits (fp32: overwritten; bf16: softmax
    # of an fp32 copy), so the underflowing row 3, and only it, was rebuilt
    assert rebuilt == [1]


def test_chunked_loss_stays_exact_when_the_target_probability_underflows():
    """A token whose target logit is ~200 below the others (a loss of ~200 nats, as in a
    divergence): its fp32 softmax probability is 0, yet loss and gradients equal PyTorch's
    log-softmax cross-entropy's on the full logits."""
    torch.manual_seed(4)
    vocab, width = 40, 8
    hidden = torch.randn(1, 6, width)
    weight = torch.randn(vocab, width)
    targets = torch.randint(1, vocab, (1, 6))
    hidden[0, 2] = 0.0
    hidden[0, 2, 0] = 100.0
    weight[:, 0] = 1.0
    weight[targets[0, 2], 0] = -1.0  # target logit -100, every other logit +100 for token 2
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    reference = cross_entropy_loss(F.linear(hidden, weight), targets)
    ref_grads = torch.autograd.grad(reference.loss, [hidden, weight])
    assert reference.loss.item() > 30  # one token of six at ~200 nats
    out = chunked_lm_loss(hidden, weight, targets, vocab_size=vocab, chunk_size=4)
    grads = torch.autograd.grad(out.loss, [hidden, weight])
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        evaluated = chunked_lm_loss(hidden, weight, targets, vocab_size=vocab, chunk_size=4)
    torch.testing.assert_close(evaluated.loss, reference.loss, rtol=1e-6, atol=1e-5)


def test_the_chunk_kernel_reads_no_value_off_the_cpu(monkeypatch):
    """Off the CPU (here the meta device, which has no values at all) the eager kernel takes
    the exact logsumexp path: no tensor is turned into a Python value, i.e. no host sync."""
    from densetrain.models.loss import _softmax_and_lse

    logits = torch.empty(4, 50, device="meta")
    targets = torch.zeros(4, dtype=torch.long, device="meta")
    for name in ("__bool__", "item", "__int__", "__float__"):
        def refuse(self, *args, _name=name, **kwargs):
            raise AssertionError(f"Tensor.{_name} called: a host sync")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    lse, logit_t, probs = _softmax_and_lse(logits, targets, True, row_logits=logits.__getitem__)
    monkeypatch.undo()
    assert lse.shape == (4,) and logit_t.shape == (4,) and probs.shape == (4, 50)


def test_the_unit_seed_check_reads_no_value_off_the_cpu(monkeypatch):
    """The backward's seed is read only on the CPU: off it (the meta device) the check answers
    False without turning a tensor into a Python value; on the CPU it tells 1 from the rest."""
    from densetrain.models.loss import _unit_seed_on_cpu

    for name in ("__bool__", "item", "__int__", "__float__"):
        def refuse(self, *args, _name=name, **kwargs):
            raise AssertionError(f"Tensor.{_name} called: a host sync")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    assert _unit_seed_on_cpu(torch.ones((), device="meta")) is False
    monkeypatch.undo()
    assert _unit_seed_on_cpu(torch.ones(())) is True
    assert _unit_seed_on_cpu(torch.tensor(0.5)) is False


class _LiveBuffers(TorchDispatchMode):
    """Counts the tensor storages of at least ``nbytes`` alive at once (each op's outputs are
    registered; a storage leaves the count when it is freed)."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes, self.alive, self.peak = nbytes, set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() >= self.nbytes and storage.data_ptr() not in self.alive:
                self.alive.add(storage.data_ptr())
                weakref.finalize(storage, self.alive.discard, storage.data_ptr())
                self.peak = max(self.peak, len(self.alive))
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_the_chunked_loss_holds_one_chunk_of_probabilities_at_a_time(autocast, head_layout):
    """However many chunks, at most one [C, V] buffer of the logits' size is alive at a time in
    fp32 (the softmax overwrites the logits), two under bf16 autocast (the bf16 logits or
    probabilities beside the fp32 softmax); every other tensor here is smaller than a chunk."""
    torch.manual_seed(0)
    chunk, vocab, width = 64, 1000, 8
    hidden = torch.randn(1, 3 * chunk, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (1, 3 * chunk))
    itemsize = 2 if autocast else 4
    live = _LiveBuffers(chunk * vocab * itemsize)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), live:
        chunked_lm_loss(hidden, weight, targets, vocab_size=vocab, chunk_size=chunk)
    assert live.peak == (2 if autocast else 1)


def _small_chunked_loss():
    """A 16-token, 40-class chunked loss in chunks of 4, with its unchunked reference loss."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 8, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (2, 8))
    out = chunked_lm_loss(hidden, weight, targets, vocab_size=40, chunk_size=4)
    reference = cross_entropy_loss(F.linear(hidden, weight), targets).loss
    return hidden, weight, out, reference


def test_a_second_backward_through_the_chunked_loss_fails_loudly():
    """The saved gradients are scaled in place in backward (no [P, E] copy), so a second
    backward through a retained graph must raise, not return gradients scaled twice."""
    hidden, weight, out, reference = _small_chunked_loss()
    expected = torch.autograd.grad(reference * 2, [hidden, weight])
    (out.loss * 2).backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, expected[0])
    torch.testing.assert_close(weight.grad, expected[1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


def test_unit_seeded_backwards_leave_the_saved_gradients_whole():
    """A backward seeded with 1 returns the saved gradients unscaled (on the CPU no pass over
    them). Through a retained graph the second backward still sums right; the gradients it
    accumulated into are the saved ones, so a third must raise rather than read them."""
    hidden, weight, out, reference = _small_chunked_loss()
    expected = torch.autograd.grad(reference, [hidden, weight])
    out.loss.backward(retain_graph=True)
    out.loss.backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, 2 * expected[0])
    torch.testing.assert_close(weight.grad, 2 * expected[1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss * 3).backward()


def test_the_transposing_cast_and_the_blocked_input_gradient(monkeypatch):
    """The [E, V] copy written a block of rows at a time (or by inductor) is the weight's
    transpose, exactly; the
    input gradient summed over blocks of vocab rows is p @ w to the rounding of its bf16
    partial products (fp64 reference)."""
    monkeypatch.setattr(loss_module, "TRANSPOSE_ROWS", 7)
    monkeypatch.setattr(loss_module, "DX_BLOCK", 13)
    torch.manual_seed(5)
    weight = torch.randn(50, 6)
    weight_EV = loss_module._transposed_cast(weight, torch.bfloat16)
    assert weight_EV.is_contiguous() and weight_EV.shape == (6, 50)
    assert torch.equal(weight_EV, weight.t().to(torch.bfloat16))
    compiled_EV = loss_module.compiled_transposed_cast()(weight, torch.bfloat16)
    assert compiled_EV.is_contiguous() and torch.equal(compiled_EV, weight_EV)
    probs = torch.softmax(torch.randn(9, 50), dim=-1).to(torch.bfloat16)
    rows = loss_module._blocked_input_grad(probs, weight_EV, torch.float32)
    assert rows.dtype == torch.float32
    exact = probs.double() @ weight_EV.double().t()
    torch.testing.assert_close(rows.double(), exact, rtol=0, atol=2**-8 * exact.abs().max())
