"""Parity ladder through the trainer: `densetrain.train.train()` (the code users run) on every
layout it supports, against the one-process run of the same job.

Each layout trains the tiny job for 4 steps with evaluation at steps 2 and 4, a final checkpoint
and the end-of-run sample. Compared with the one-process control: per-step training loss and
gradient norm, both validation losses, the greedy sample, and the final weights read back from
each run's checkpoint on one process (DCP reshards any layout's checkpoint to a whole model).

The published families (`FAMILIES`: the ladder's `ARCHITECTURES` as ``--model.*`` overrides of
the tiny job, plus Gopher's Transformer-XL relative positions) train under the parallelism
their authors used (`FAMILY_TWO_RANK`, `FAMILY_FOUR_RANK`), each compared with the one-process
run of the same model: the controls are keyed by the job's model overrides.

Tolerance: the layouts reorder float32 sums (gradient reduction over ranks, TP partial sums,
attention over gathered keys, microbatch means), a few ulps per step that four AdamW updates
grow to ~1e-6 in the losses; rel 1e-4 / abs 1e-5 on losses and norms and 5e-5 absolute on the
weights are far below what a real bug moves (a missed 1/N or all-reduce: > 1e-3 in the loss).
"""

from __future__ import annotations

from pathlib import Path

import ladder
import pytest
import torch

from densetrain.testing import TINY_OVERRIDES, run_distributed, tiny_job_overrides
from densetrain.train import read_metrics, train

STEPS = ["--training.steps=4", "--eval.interval=2", "--eval.sample_tokens=6",
         "--checkpoint.interval=4", "--checkpoint.keep_last=1", "--logging.plot=false",
         "--optim.grad_clip=0.5"]
TOL = {"rel": 1e-4, "abs": 1e-5}
WEIGHT_TOL = 5e-5

TWO_RANK = {
    "ddp": ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"],
    "zero1": ["--parallel.dp_shard=2", "--parallel.zero_stage=1"],
    "zero2": ["--parallel.dp_shard=2", "--parallel.zero_stage=2"],
    "zero3": ["--parallel.dp_shard=2"],
    "zero3_ac": ["--parallel.dp_shard=2", "--parallel.activation_checkpointing=full"],
    "tp": ["--parallel.tp=2", "--parallel.dp_shard=1", "--parallel.sequence_parallel=false"],
    "tp_sp": ["--parallel.tp=2", "--parallel.dp_shard=1"],
    "cp": ["--parallel.cp=2", "--parallel.dp_shard=1"],
    "pp_gpipe": ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=gpipe"],
    "pp_1f1b": ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=1f1b"],
}
FAST = ("ddp", "zero2", "tp_sp", "cp", "pp_1f1b")
FOUR_RANK = {
    "hsdp": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2",
             "--training.micro_batch_size=2"],
    # dp_shard = 1: FSDP shards over the cp ranks alone
    "hsdp_cp": ["--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.dp_shard=1",
                "--training.micro_batch_size=2"],
    "fsdp_tp": ["--parallel.dp_shard=2", "--parallel.tp=2"],
    "cp_tp": ["--parallel.cp=2", "--parallel.tp=2", "--parallel.dp_shard=1"],
    "pp_fsdp": ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_microbatches=2"],
    "pp_tp": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.dp_shard=1"],
    "pp_interleaved": ["--parallel.pp=2", "--parallel.dp_shard=2", "--model.num_layers=4",
                       "--parallel.pp_schedule=interleaved_1f1b",
                       "--parallel.pp_virtual_stages=2", "--parallel.pp_microbatches=2"],
}


def _model_args(fields: dict) -> list[str]:
    """``--model.*`` overrides setting ``fields`` (booleans as the loader spells them)."""
    return [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in fields.items()]


# The families' tiny models: the ladder's architectures on the tiny job's widths, and Gopher /
# Chinchilla (Llama-style RMSNorm pre-norm blocks with Transformer-XL relative positions).
FAMILIES = {
    **{arch: _model_args(ladder.ARCHITECTURES[arch])
       for arch in ("gpt2", "neox", "palm", "phi", "bloom", "qwen3")},
    "gopher": _model_args({"position_embedding": "relative_xl"}),
}
# Each family under the parallelism its authors trained it with: GPT-2 / GPT-3, GPT-NeoX, PaLM
# and Qwen3 on Megatron-style tensor + sequence parallel; BLOOM on tensor parallel, and on
# context parallel for its ALiBi masks at global positions; Gopher on TP (W_R, u and v split
# with the heads) and CP (relative scores at global distances); phi-1 (data parallel) on FSDP.
# `FAMILY_FAST` runs in the default suite.
FAMILY_TWO_RANK = {
    "gpt2_tp_sp": FAMILIES["gpt2"] + TWO_RANK["tp_sp"],
    "neox_tp_sp": FAMILIES["neox"] + TWO_RANK["tp_sp"],
    "palm_tp_sp": FAMILIES["palm"] + TWO_RANK["tp_sp"],
    "phi_zero3": FAMILIES["phi"] + TWO_RANK["zero3"],
    "bloom_cp": FAMILIES["bloom"] + TWO_RANK["cp"],
    "bloom_tp": FAMILIES["bloom"] + TWO_RANK["tp"],
    "qwen3_tp_sp": FAMILIES["qwen3"] + TWO_RANK["tp_sp"],
    "gopher_tp_sp": FAMILIES["gopher"] + TWO_RANK["tp_sp"],
    "gopher_cp": FAMILIES["gopher"] + TWO_RANK["cp"],
}
FAMILY_FAST = ("palm_tp_sp",)
FAMILY_FOUR_RANK = {
    "neox_pp_tp": FAMILIES["neox"] + FOUR_RANK["pp_tp"],
    "palm_pp_tp": FAMILIES["palm"] + FOUR_RANK["pp_tp"],
    "bloom_fsdp_tp": FAMILIES["bloom"] + FOUR_RANK["fsdp_tp"],
}


def _train_layouts(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> list[dict]:
    from densetrain.config import load_job_config

    torch.set_num_threads(1)
    return [train(load_job_config(None, overrides)) for _, overrides in runs]


def _model_overrides(extra: list[str]) -> tuple[tuple[str, str], ...]:
    """The job's whole model: the tiny job's ``--model.*`` overrides with ``extra``'s applied
    (later ones win), as sorted (key, value) pairs: the key of a layout's control."""
    fields: dict[str, str] = {}
    for arg in [*TINY_OVERRIDES, *extra]:
        if arg.startswith("--model."):
            key, _, value = arg.partition("=")
            fields[key] = value
    return tuple(sorted(fields.items()))


def _final_weights(run_dir: Path, model: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    """The final checkpoint's model (``model``: `_model_overrides`), loaded on one process into
    a whole model."""
    from densetrain.checkpoint import ModelState, latest_checkpoint, load_checkpoint
    from densetrain.config import load_job_config
    from densetrain.models import Transformer

    job = load_job_config(None, [*TINY_OVERRIDES, *(f"{k}={v}" for k, v in model)])
    model = Transformer(job.build_model_config(512))
    load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), {"model": ModelState(model)})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _base(run_dir: Path, cache: str) -> list[str]:
    return tiny_job_overrides(cache_dir=cache, run_dir=str(run_dir), extra=tuple(STEPS))


class Controls:
    """One-process runs of the job, one per model (`_model_overrides`), trained on first use,
    and the corpus cache they prepare."""

    def __init__(self, root: Path) -> None:
        self.root, self.cache = root, str(root / "cache")
        self._runs: dict[tuple, dict] = {}

    def of(self, extra: list[str]) -> dict:
        """The control of a layout given by its overrides ``extra``: the one-process run with
        the same model overrides."""
        from densetrain.config import load_job_config

        model = _model_overrides(extra)
        if model not in self._runs:
            run_dir = self.root / f"control{len(self._runs)}"
            args = _base(run_dir, self.cache) + [f"{k}={v}" for k, v in model]
            summary = train(load_job_config(None, args))
            self._runs[model] = {"summary": summary, "metrics": read_metrics(run_dir),
                                 "dir": run_dir, "model": model}
        return self._runs[model]


@pytest.fixture(scope="module")
def controls(tmp_path_factory) -> Controls:
    return Controls(tmp_path_factory.mktemp("trainer-ladder"))


def _compare(name: str, summary: dict, run_dir: Path, control: dict) -> None:
    got, ref = read_metrics(run_dir), control["metrics"]
    assert [r["step"] for r in got] == [r["step"] for r in ref], name
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], **TOL), (name, key)
    val = [r["val_loss"] for r in got if "val_loss" in r]
    assert len(val) == 2, name
    assert val == pytest.approx([r["val_loss"] for r in ref if "val_loss" in r], **TOL), name
    assert summary["sample"] == control["summary"]["sample"], name
    weights = _final_weights(run_dir, control["model"])
    reference = _final_weights(control["dir"], control["model"])
    assert set(weights) == set(reference), name
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHT_TOL, rtol=0,
                                   msg=lambda m, k=key: f"{name} {k}: {m}")


def _run_ladder(layouts: dict[str, list[str]], world: int, controls: Controls,
                timeout: float) -> None:
    # the controls first: the first one prepares the corpus cache the ranks read
    for extra in layouts.values():
        controls.of(extra)
    runs = [(name, _base(controls.root / name, controls.cache) + extra)
            for name, extra in layouts.items()]
    results = run_distributed(_train_layouts, world, runs, timeout=timeout)
    for (name, _), summary in zip(runs, results[0], strict=True):
        _compare(name, summary, controls.root / name, controls.of(layouts[name]))


def test_trainer_layouts_on_two_ranks_match_one_process(controls) -> None:
    _run_ladder({k: TWO_RANK[k] for k in FAST}, 2, controls, timeout=420)


@pytest.mark.slow
def test_all_trainer_layouts_on_two_ranks_match_one_process(controls) -> None:
    _run_ladder({k: v for k, v in TWO_RANK.items() if k not in FAST}, 2, controls, timeout=600)


@pytest.mark.slow
def test_trainer_layouts_on_four_ranks_match_one_process(controls) -> None:
    _run_ladder(FOUR_RANK, 4, controls, timeout=900)


def test_trainer_families_fast_on_two_ranks_match_their_one_process_runs(controls) -> None:
    _run_ladder({k: FAMILY_TWO_RANK[k] for k in FAMILY_FAST}, 2, controls, timeout=300)


@pytest.mark.slow
def test_trainer_families_on_two_ranks_match_their_one_process_runs(controls) -> None:
    _run_ladder({k: v for k, v in FAMILY_TWO_RANK.items() if k not in FAMILY_FAST}, 2, controls,
                timeout=900)


@pytest.mark.slow
def test_trainer_families_on_four_ranks_match_their_one_process_runs(controls) -> None:
    _run_ladder(FAMILY_FOUR_RANK, 4, controls, timeout=900)
