"""bf16 parameters with fp32 master weights on layouts without sharded data parallelism.

Under ``training.dtype = "bf16"`` and ``parallel.param_dtype = "compute"`` (the default), tensor
parallel, pipeline parallel and plain data parallel (also combined with either, which DDP does
not compose with) compute in bf16 copies of fp32 parameters (FSDP2 over a one-rank shard
group, `parallelize.single_rank_fsdp`), so that the residual
stream, the tensor-parallel collectives and the pipeline sends are bf16; ``param_dtype =
"fp32"`` keeps fp32 parameters under autocast. Each layout trains the tiny job on real gloo
ranks through `train()` both ways and:

- the layers see bf16 weights with "compute" and fp32 ones with "fp32"; the parameters the
  optimizer steps are fp32 either way; the residual stream (a block's output) is bf16 with
  "compute", fp32 with "fp32";
- the losses of the two agree within bf16 rounding (a few steps of 8-bit-mantissa matmuls:
  2% relative, as for FSDP's bf16 gathers), and each follows the one-process bf16 run as
  closely; the final weights read back from the checkpoint are fp32 and agree to bf16
  rounding of the updates.

A missed gradient reduction or a gradient accumulated in bf16 moves the losses by far more
after the 6 steps (each step averages 2 microbatches).
"""

from __future__ import annotations

import pytest
import torch

from densetrain.testing import run_distributed, tiny_job_overrides

COMMON = ("--training.steps=6", "--training.dtype=bf16", "--eval.interval=0",
          "--checkpoint.interval=6", "--checkpoint.keep_last=1", "--logging.plot=false",
          "--eval.sample_tokens=0", "--training.micro_batch_size=2")
LAYOUTS = {
    "tp_sp": ["--parallel.tp=2", "--parallel.dp_shard=1"],
    "pp_1f1b": ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=1f1b"],
    "ddp": ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
}
FOUR_RANK = {
    "pp_tp": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.dp_shard=1"],
    "pp_tp_microbatch": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.dp_shard=1",
                          "--parallel.pp_grad_reduce=microbatch"],
}
REPLICATED = {  # plain data parallel with tp or pp runs with bf16 parameters only (HSDP)
    "ddp_tp": ["--parallel.dp_replicate=2", "--parallel.tp=2", "--parallel.dp_shard=1"],
    "ddp_pp": ["--parallel.dp_replicate=2", "--parallel.pp=2", "--parallel.dp_shard=1"],
}
BF16_REL = 2e-2


def _watcher(seen: dict):
    """A callback recording what the first block this rank holds sees and returns."""
    from densetrain.train.callbacks import Callback

    def before(mod, args) -> None:
        seen.setdefault("forward", str(mod.attn.wq.weight.dtype))

    def after(mod, args, output) -> None:
        value = output[0] if isinstance(output, tuple) else output
        seen.setdefault("residual", str(value.dtype))

    class Watch(Callback):
        def on_train_start(self, parts, *args, **kwargs) -> None:
            module = parts.model.module
            stages = getattr(module, "pipeline", None)
            root = stages.stages[0].submod if stages is not None else module
            block = next(iter(root.layers.values()))
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after)
            seen["stored"] = sorted({str(p.dtype) for p in module.parameters()})
            seen["optimized"] = sorted({str(p.dtype) for g in parts.optimizer.param_groups
                                        for p in g["params"]})

    return Watch()


def _train_and_watch(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Train each run; return its losses and what `_watcher` saw."""
    from densetrain.config import load_job_config
    from densetrain.train import read_metrics, train

    torch.set_num_threads(1)
    out = []
    for overrides in runs:
        seen: dict[str, str] = {}
        job = load_job_config(None, overrides)
        train(job, callbacks=[_watcher(seen)])
        records = read_metrics(job.logging.run_dir)
        out.append({"losses": [r["loss"] for r in records if "loss" in r], **seen})
    return out


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    from densetrain.checkpoint import ModelState, latest_checkpoint, load_checkpoint
    from densetrain.config import load_job_config
    from densetrain.models import Transformer
    from densetrain.testing import TINY_OVERRIDES

    model = Transformer(load_job_config(None, list(TINY_OVERRIDES)).build_model_config(512))
    load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), {"model": ModelState(model)})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    from densetrain.config import load_job_config
    from densetrain.train import read_metrics, train

    root = tmp_path_factory.mktemp("bf16-params")
    cache = str(root / "cache")
    run_dir = root / "control"
    train(load_job_config(None, tiny_job_overrides(cache_dir=cache, run_dir=str(run_dir),
                                                   extra=COMMON)))
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    return {"root": root, "cache": cache, "losses": losses, "dir": run_dir}


def _check(layouts: dict[str, list[str]], world: int, control: dict, timeout: float,
           settings: tuple[str, ...] = ("compute", "fp32")) -> None:
    runs, names = [], []
    for name, extra in layouts.items():
        for setting in settings:
            run_dir = control["root"] / f"{name}-{setting}"
            names.append((name, setting, run_dir))
            runs.append(tiny_job_overrides(
                cache_dir=control["cache"], run_dir=str(run_dir),
                extra=(*COMMON, *extra, f"--parallel.param_dtype={setting}")))
    results = run_distributed(_train_and_watch, world, runs, timeout=timeout)
    by_run = {}
    for (name, setting, run_dir), per_rank in zip(names, zip(*results, strict=True),
                                                  strict=True):
        for seen in per_rank:
            assert seen["stored"] == seen["optimized"] == ["torch.float32"], (name, setting)
            expected = "torch.bfloat16" if setting == "compute" else "torch.float32"
            assert seen["forward"] == expected, (name, setting, seen)
            assert seen["residual"] == expected, (name, setting, seen)
        losses = per_rank[0]["losses"]
        assert len(losses) == len(control["losses"]) == 6, (name, setting)
        assert torch.isfinite(torch.tensor(losses)).all(), (name, setting)
        assert losses == pytest.approx(control["losses"], rel=BF16_REL), (name, setting)
        by_run[name, setting] = (losses, run_dir)
    for name in layouts if "fp32" in settings else ():
        (bf16, bf16_dir), (fp32, fp32_dir) = by_run[name, "compute"], by_run[name, "fp32"]
        assert bf16 == pytest.approx(fp32, rel=BF16_REL), name
        assert bf16 != fp32, f"{name}: bf16 parameters changed nothing"
        weights, reference = _final_weights(bf16_dir), _final_weights(fp32_dir)
        for key, value in reference.items():
            assert weights[key].dtype == torch.float32, key
            # six AdamW steps of lr 3e-3 move a weight by at most ~0.02; bf16 forward
            # rounding changes the updates by a fraction of that
            torch.testing.assert_close(weights[key], value, atol=2e-2, rtol=0,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")


def test_bf16_parameters_on_two_ranks(control) -> None:
    _check(LAYOUTS, 2, control, timeout=480)


@pytest.mark.slow
def test_bf16_parameters_on_four_ranks(control) -> None:
    _check(FOUR_RANK, 4, control, timeout=600)


@pytest.mark.slow
def test_bf16_parameters_replicated_with_tp_and_pp(control) -> None:
    _check(REPLICATED, 4, control, timeout=600, settings=("compute",))
