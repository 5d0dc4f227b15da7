"""FSDP gathers parameters in the compute dtype (``parallel.param_dtype = "compute"``).

Two real gloo ranks (FSDP over dp_shard 2) train the tiny job under bf16 autocast: the layers
see bf16 weights during forward (gathered in bf16) with "compute" and fp32 ones with "fp32",
the sharded parameters, gradients and optimizer states stay fp32 either way, and both runs
follow the one-process bf16 run within bf16's precision.
"""

from __future__ import annotations

import pytest
import torch

from densetrain.testing import run_distributed

COMMON = ["--training.steps=6", "--training.dtype=bf16", "--eval.interval=0",
          "--checkpoint.enabled=false", "--logging.plot=false", "--eval.sample_tokens=0"]


def _train_and_watch(rank: int, world_size: int, overrides: list[str]) -> dict:
    """Train; record the dtype of the first block's weights as its forward sees them."""
    from densetrain.config import load_job_config
    from densetrain.train import read_metrics, train
    from densetrain.train.callbacks import Callback

    seen: dict[str, str] = {}

    class Watch(Callback):
        def on_train_start(self, parts, *args, **kwargs) -> None:
            module = parts.model.module
            block = module.layers["0"]

            def record(mod, args) -> None:
                seen.setdefault("forward", str(mod.attn.wq.weight.dtype))

            block.register_forward_pre_hook(record)
            seen["stored"] = str(next(block.parameters()).dtype)

    job = load_job_config(None, overrides)
    train(job, callbacks=[Watch()])
    records = read_metrics(job.logging.run_dir)
    return {"losses": [r["loss"] for r in records if "loss" in r], **seen}


@pytest.mark.parametrize(("setting", "forward_dtype"), [("compute", "torch.bfloat16"),
                                                        ("fp32", "torch.float32")])
def test_fsdp_gathers_in_the_compute_dtype(make_job, tiny_overrides, tmp_path, setting,
                                           forward_dtype) -> None:
    from densetrain.train import read_metrics, train

    single = make_job(*COMMON, run="single")
    train(single)
    reference = [r["loss"] for r in read_metrics(single.logging.run_dir) if "loss" in r]

    overrides = tiny_overrides + COMMON + [
        f"--data.cache_dir={single.data.cache_dir}", f"--logging.run_dir={tmp_path / setting}",
        "--parallel.dp_shard=2", f"--parallel.param_dtype={setting}"]
    results = run_distributed(_train_and_watch, 2, overrides, timeout=240)
    for result in results:
        assert result["forward"] == forward_dtype
        assert result["stored"] == "torch.float32"  # sharded master weights stay fp32
    assert len(results[0]["losses"]) == len(reference) == 6
    # bf16 precision (8 bits of mantissa) over a few steps of the same batches
    assert results[0]["losses"] == pytest.approx(reference, rel=2e-2)
    assert torch.isfinite(torch.tensor(results[0]["losses"])).all()
