"""The CUDA paths of the trainer, run when a GPU is present (skipped otherwise): the same job on
the GPU as on the CPU, bf16 + compile, float8 against bf16, the datasheet peak, pinned batches,
and the chunked loss's GPU kernel (values, gradients and the memory of one chunk)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cuda-corpus"))


def _losses(tmp_path, cache: str, name: str, *extra: str) -> list[float]:
    from densetrain.config import load_job_config
    from densetrain.testing import tiny_job_overrides
    from densetrain.train import read_metrics, train

    run_dir = tmp_path / name
    train(load_job_config(None, tiny_job_overrides(
        cache_dir=cache, run_dir=str(run_dir),
        extra=("--checkpoint.enabled=false", "--eval.interval=100", *extra))))
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def test_fp32_job_on_the_gpu_matches_the_cpu(tmp_path, cache):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = _losses(tmp_path, cache, "cpu", "--training.device=cpu")
    gpu = _losses(tmp_path, cache, "gpu", "--training.device=cuda")
    assert len(cpu) == len(gpu) == 20
    assert max(abs(a - b) for a, b in zip(cpu, gpu, strict=True)) < 2e-3


def test_bf16_compile_on_the_gpu_learns(tmp_path, cache):
    losses = _losses(tmp_path, cache, "bf16", "--training.device=cuda", "--training.dtype=bf16",
                     "--training.compile=true")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.4


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 tensor cores need compute capability 8.9+")
def test_float8_on_the_gpu_tracks_bf16(tmp_path, cache):
    pytest.importorskip("torchao.float8")
    bf16 = _losses(tmp_path, cache, "b", "--training.device=cuda", "--training.dtype=bf16")
    fp8 = _losses(tmp_path, cache, "f", "--training.device=cuda", "--training.dtype=float8")
    assert max(abs(a - b) for a, b in zip(bf16, fp8, strict=True)) < 0.03


def test_peak_comes_from_the_datasheet():
    from densetrain.train.metrics import device_peak_flops

    peak, source = device_peak_flops(torch.device("cuda"), "bf16")
    assert source.startswith("datasheet") and peak > 1e14, (peak, source)


def test_batches_reach_the_gpu_through_pinned_memory():
    from densetrain.data import Batch
    from densetrain.parallel.model import SpmdModel

    tokens = torch.arange(2 * 9).view(2, 9)
    batch = Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())
    laid_out = SpmdModel(module=torch.nn.Identity())
    moved = laid_out.prepare_batch(batch, torch.device("cuda"))
    torch.cuda.synchronize()
    assert moved.inputs.is_cuda and torch.equal(moved.inputs.cpu(), batch.inputs)


@pytest.mark.parametrize(("autocast", "compiled"), [(False, False), (True, False), (True, True)])
def test_chunked_loss_on_the_gpu_equals_full_logits_and_holds_about_one_chunk(autocast, compiled):
    """On the GPU the chunked loss takes the exact kernel (logsumexp, then the exponential in
    place; inductor's under bf16 + compile): its loss and gradients equal the fp64 full-logits
    cross-entropy, and its forward holds one chunk's buffers at a time, never the full [N, V]
    logits (8 chunks here): at most the fp32 probabilities, logsumexp's temporary and the bf16
    logits (2.5 fp32 chunks) beside the weight gradient and the bf16 weight."""
    import torch.nn.functional as F

    from densetrain.models.loss import chunked_lm_loss, cross_entropy_loss

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    tokens, width, vocab, chunk = 2048, 64, 32000, 256
    hidden = torch.randn(1, tokens, width, generator=gen).cuda().requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen) * 0.05).cuda().requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=gen).cuda()
    reference = cross_entropy_loss(F.linear(hidden.double(), weight.double()), targets)
    want = torch.autograd.grad(reference.loss, [hidden, weight])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = chunked_lm_loss(hidden, weight, targets, vocab_size=vocab, chunk_size=chunk,
                              compiled=compiled)
    grown = torch.cuda.max_memory_allocated() - before
    got = torch.autograd.grad(out.loss, [hidden, weight])
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(out.loss, reference.loss, rtol=tol, atol=tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item())
    assert grown < 3 * (chunk * vocab * 4) + 2 * (weight.numel() * 4), grown


def test_a_cuda_index_past_the_visible_devices_is_refused():
    from densetrain.train.device import resolve_device

    count = torch.cuda.device_count()
    assert resolve_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(ValueError, match=rf"only {count} CUDA device\(s\) are visible"):
        resolve_device(f"cuda:{count}")
