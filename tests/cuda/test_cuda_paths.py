"""The CUDA paths of the trainer, run when a GPU is present (skipped otherwise): the same job on
the GPU as on the CPU, bf16 + compile, float8 against bf16, the datasheet peak, pinned batches."""

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
    from densetrain.parallel.model import LaidOutModel

    tokens = torch.arange(2 * 9).view(2, 9)
    batch = Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())
    laid_out = LaidOutModel(module=torch.nn.Identity())
    moved = laid_out.prepare_batch(batch, torch.device("cuda"))
    torch.cuda.synchronize()
    assert moved.inputs.is_cuda and torch.equal(moved.inputs.cpu(), batch.inputs)
