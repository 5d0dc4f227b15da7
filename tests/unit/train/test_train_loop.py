"""End-to-end trainer behaviour on a tiny model: learning, exact resume, NaN guard, bad resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from densetrain.checkpoint import CheckpointShapeError, latest_checkpoint, list_checkpoints
from densetrain.checkpoint.resume import ConfigChangeError
from densetrain.testing.callbacks import InterruptAfter
from densetrain.train import Callback, NonFiniteLossError, read_metrics, train

REQUIRED_METRICS = {"step", "loss", "lr", "tokens", "tokens_per_s", "mfu"}


class _PoisonWeights(Callback):
    """Writes a NaN into the model after step ``at`` (as a diverging update would)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, parts, progress, report) -> None:
        if progress.step == self.at:
            with torch.no_grad():
                parts.model.module.layers["0"].attn.wq.weight[0, 0] = float("nan")


def test_loss_falls_and_run_files_are_written(make_job) -> None:
    job = make_job("--training.steps=30", "--eval.interval=15", "--checkpoint.keep_last=1")
    summary = train(job)
    run_dir = Path(job.logging.run_dir)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(REQUIRED_METRICS <= set(r) for r in records)
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.5, (first, last)  # from about ln(512) = 6.2 down by over half a nat
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert math.isclose(evals[-1]["val_ppl"], math.exp(evals[-1]["val_loss"]), rel_tol=1e-9)
    assert records[-1]["tokens"] == 30 * 8 * 32
    assert 0 < records[-1]["mfu"] < 1 and records[-1]["tokens_per_s"] > 0
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in ("final_loss", "final_val_loss", "tokens", "steps", "params",
                "non_embedding_params", "flops"):
        assert key in summary and key in on_disk
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 8 * 32
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    assert summary["flops"] == pytest.approx(summary["flops_per_token"] * summary["tokens"])
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [30]  # keep_last=1
    assert "[model]" in (latest_checkpoint(run_dir / "checkpoints") / "config.toml").read_text()


def test_interrupted_then_resumed_run_is_bit_exact(make_job) -> None:
    steps = ["--training.steps=8", "--checkpoint.interval=4", "--eval.interval=0"]
    reference_job = make_job(*steps, "--eval.sample_tokens=0", run="straight")
    reference = train(reference_job)
    job = make_job(*steps, "--eval.sample_tokens=0", run="interrupted")
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[InterruptAfter(at=4)])
    assert latest_checkpoint(Path(job.logging.run_dir) / "checkpoints").name == "step-00000004"
    resumed = train(job)
    assert resumed["resumed_from"].endswith("step-00000004")
    def curve(run_dir: str) -> list[tuple]:
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(run_dir)]

    straight, again = curve(reference_job.logging.run_dir), curve(job.logging.run_dir)
    assert again == straight  # bit for bit, and the metrics file has no duplicated steps
    assert resumed["final_loss"] == reference["final_loss"]
    assert resumed["tokens"] == reference["tokens"]


def test_nan_stops_naming_the_step_and_never_saves_it(make_job) -> None:
    job = make_job("--training.steps=8", "--checkpoint.interval=2", "--eval.interval=0")
    with pytest.raises(NonFiniteLossError, match="step 4"):
        train(job, callbacks=[_PoisonWeights(at=3)])
    checkpoints = Path(job.logging.run_dir) / "checkpoints"
    assert [s for s, _ in list_checkpoints(checkpoints)] == [2]


def test_resume_from_another_model_shape_names_the_tensor(make_job) -> None:
    train(make_job("--training.steps=3", "--eval.interval=0", "--eval.sample_tokens=0"))
    wider = make_job(
        "--training.steps=4", "--model.dim=96", "--model.embed_dim=96", "--model.head_dim=24",
        "--eval.interval=0",
    )
    with pytest.raises(ConfigChangeError, match=r"model\.dim: 64 -> 96"):
        train(wider)  # the saved config.toml is compared first
    wider.checkpoint.allow_config_change = True
    with pytest.raises(CheckpointShapeError, match=r"tok_embeddings\.weight.*64.*96"):
        train(wider)  # told to go on, the shapes are still checked before any value changes


def test_cli_train_runs_with_overrides(make_job, tiny_overrides, capsys, tmp_path) -> None:
    from densetrain.cli.main import main

    job = make_job(run="cli")
    argv = ["train", *tiny_overrides, f"--data.cache_dir={job.data.cache_dir}",
            f"--logging.run_dir={tmp_path / 'cli'}", "--training.steps=3", "--eval.interval=0",
            "--checkpoint.enabled=false", "--logging.plot=false", "--logging.peak_tflops=2.5"]
    assert main(argv) == 0
    ending = capsys.readouterr().out
    assert ending.startswith("done: 3 steps in ") and "val loss - (eval.interval=0)" in ending
    assert len(ending.splitlines()) == 5  # the summary stays in summary.json
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 8 * 32
    # a pinned peak replaces the probe: MFU = achieved model FLOP/s over 2.5 TFLOP/s
    assert summary["peak_flops_source"] == "pinned by logging.peak_tflops"
    assert summary["peak_flops_per_device"] == 2.5e12
    assert summary["mfu"] == pytest.approx(
        summary["tokens_per_s"] * summary["flops_per_token"] / 2.5e12)
    assert (tmp_path / "cli" / "summary.json").exists()


class _CaptureInitialWeights(Callback):
    def on_train_start(self, parts, progress) -> None:
        self.weights = {k: v.detach().clone()
                        for k, v in parts.model.module.state_dict().items()}


def test_init_from_hugging_face_directory_starts_from_its_weights(make_job, tmp_path) -> None:
    from densetrain.models import Transformer
    from densetrain.models.hf import save_hf

    job = make_job("--training.steps=3", "--eval.interval=0", "--eval.sample_tokens=0",
                   "--checkpoint.enabled=false", "--logging.plot=false")
    source = Transformer(job.build_model_config(512))
    source.init_weights(seed=1234)  # not the job's seed: the run must take these weights
    save_hf(source, tmp_path / "hf")
    job.training.init_from = str(tmp_path / "hf")
    capture = _CaptureInitialWeights()
    train(job, callbacks=[capture])
    expected = source.state_dict()
    assert capture.weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(capture.weights[name], value), name


def test_bf16_autocast_tracks_fp32_with_fp32_master_weights(make_job, capfd) -> None:
    quiet = ["--training.steps=2", "--schedule.warmup_steps=1", "--eval.interval=0",
             "--eval.sample_tokens=0", "--checkpoint.enabled=false", "--logging.plot=false"]
    fp32 = make_job(*quiet, run="fp32")
    bf16 = make_job(*quiet, "--training.dtype=bf16", run="bf16")
    capture = _CaptureInitialWeights()
    train(fp32)
    capfd.readouterr()
    train(bf16, callbacks=[capture])
    slow = "warning: training.dtype=bf16 is slower than fp32 on this CPU"
    # once, where torch has no oneDNN bf16 kernels for this CPU (its bf16 matmuls are loops)
    expected = 0 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 1
    assert capfd.readouterr().err.count(slow) == expected
    assert all(v.dtype == torch.float32 for v in capture.weights.values())  # master weights
    ref = [r["loss"] for r in read_metrics(fp32.logging.run_dir)]
    low = [r["loss"] for r in read_metrics(bf16.logging.run_dir)]
    assert low != ref  # bf16 matmuls really ran
    assert low == pytest.approx(ref, abs=2e-2)
    # MFU against the machine's real peak, not against a reference loop's rate (was > 100%)
    assert all(0 < r["mfu"] < 1 for r in read_metrics(bf16.logging.run_dir))


class _CaptureLossKernelFlag(Callback):
    def on_train_start(self, parts, progress) -> None:
        self.compiled = parts.model.module.compile_loss_kernel


@pytest.mark.slow
def test_bf16_compile_runs_the_compiled_loss_kernel_and_tracks_fp32(make_job) -> None:
    quiet = ["--training.steps=2", "--schedule.warmup_steps=1", "--eval.interval=0",
             "--eval.sample_tokens=0", "--checkpoint.enabled=false", "--logging.plot=false"]
    fp32 = make_job(*quiet, run="fp32c")
    fast = make_job(*quiet, "--training.dtype=bf16", "--training.compile=true", run="bf16c")
    flag = _CaptureLossKernelFlag()
    train(fp32)
    train(fast, callbacks=[flag])
    assert flag.compiled
    ref = [r["loss"] for r in read_metrics(fp32.logging.run_dir)]
    low = [r["loss"] for r in read_metrics(fast.logging.run_dir)]
    assert low == pytest.approx(ref, abs=2e-2)


def test_a_restart_after_torn_log_lines_resumes_and_keeps_the_logs_whole(make_job, capsys):
    steps = ["--training.steps=6", "--checkpoint.interval=4", "--eval.interval=0",
             "--eval.sample_tokens=0"]
    job = make_job(*steps)
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[InterruptAfter(at=5)])
    run_dir = Path(job.logging.run_dir)
    for name, cut in (("metrics.jsonl", 25), ("goodput.jsonl", 25)):  # killed mid-write
        data = (run_dir / name).read_bytes()
        (run_dir / name).write_bytes(data[: len(data) - cut])
    capsys.readouterr()
    resumed = train(job)
    assert resumed["resumed_from"].endswith("step-00000004") and resumed["steps"] == 6
    assert capsys.readouterr().err.count("dropped a torn last line") == 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    from densetrain.train.goodput import read_ledger
    assert max(e["step"] for e in read_ledger(run_dir)) == 6
