"""Device names given by the user (`training.device`, `--device`): what is refused and how."""

from __future__ import annotations

import pytest
import torch

from densetrain.eval.loading import resolve_device as eval_device
from densetrain.train.device import resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only answer")


def test_cpu_and_auto_without_a_gpu():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert eval_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", ""])
def test_a_name_that_is_no_device_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match=r"training\.device=.* is not a device; allowed: auto"):
        resolve_device(name)
    with pytest.raises(ValueError, match=r"--device .*is not a device"):
        eval_device(name)


@pytest.mark.parametrize("name", ["meta", "xla"])
def test_a_device_densetrain_does_not_run_on_is_refused(name):
    with pytest.raises(ValueError, match="densetrain runs on cpu, cuda and mps"):
        resolve_device(name)


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_says_why_and_what_to_use(name):
    with pytest.raises(ValueError, match=rf"--device {name} but (this PyTorch build has no CUDA"
                                         r"|no CUDA device is visible).*use 'cpu' or 'auto'"):
        eval_device(name)
