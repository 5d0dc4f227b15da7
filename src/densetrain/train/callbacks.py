"""Callbacks of the trainer: metrics logging and progress, checkpoints, the plot, the sample.

Each callback is built with its own settings and sees the run's built parts (`RunParts`), its
checkpointed progress and, after every step, that step's `StepReport` (evaluation included). No
callback writes into shared state, so their order does not matter; each may contribute entries
to the run's summary (`summary()`) and releases what it holds in `close()` (also after an
exception).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from densetrain.train.device import peak_memory_bytes, peak_rss_bytes
from densetrain.train.evaluation import mean_over_ranks, sample_text
from densetrain.train.metrics import MetricsWriter, mfu, read_metrics
from densetrain.train.state import Progress, RunParts, StepReport


class Callback:
    """Hooks called by the trainer; every hook runs on every rank (collectives are allowed)."""

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Called once, after resume, before the first step of this process."""

    def on_step_end(self, parts: RunParts, progress: Progress, report: StepReport) -> None:
        """Called after each optimizer step (``progress.step`` is the step just taken)."""

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """Called after the run was rolled back to an earlier checkpoint (``progress.step``
        is the step restored; the steps after it will be taken again)."""

    def on_train_end(self, parts: RunParts, progress: Progress) -> None:
        """Called once after the last step (not after an exception)."""

    def summary(self) -> dict[str, Any]:
        """Entries this callback adds to the run's summary."""
        return {}

    def flush(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Complete background work now (a save still being written), e.g. before a rollback
        reads the checkpoint directory."""

    def close(self) -> None:
        """Release files, bars and threads (called after the run, also after an exception)."""


class MetricsLogger(Callback):
    """Every ``log_interval`` steps (and at evaluations and the last step): a metrics line,
    TensorBoard, the progress bar. The first record also holds the model-state bytes of each
    rank (parameters, gradients, optimizer states: ``parallel.memory.rank_memory``)."""

    def __init__(self, *, log_interval: int, tensorboard: bool, progress: bool) -> None:
        self.log_interval = log_interval
        self.tensorboard = tensorboard
        self.progress = progress
        self.writer: MetricsWriter | None = None
        self.bar = None
        self._last_tokens = 0
        self._last_seconds = 0.0
        self._skipped = 0
        self._first = True
        self._final_loss = float("nan")

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Open the metrics file (dropping lines after the resumed step) and the progress bar."""
        if parts.is_main:
            self.writer = MetricsWriter(parts.run_dir, tensorboard=self.tensorboard,
                                        resume_step=progress.step)
        if parts.is_main and self.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=parts.training.steps, initial=progress.step, unit="step",
                            dynamic_ncols=True, file=sys.stderr, desc="train")

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """Drop the metrics of the undone steps (``faults.jsonl`` keeps the spike) and move
        the bar back."""
        if self.writer is not None:
            self.writer.close()
            self.writer = MetricsWriter(parts.run_dir, tensorboard=self.tensorboard,
                                        resume_step=progress.step)
        if self.bar is not None:
            self.bar.n = progress.step
            self.bar.refresh()

    def on_step_end(self, parts: RunParts, progress: Progress, report: StepReport) -> None:
        """Write a record at log steps, at evaluation steps and at the last step."""
        self._skipped += int(report.skipped)
        if self.bar is not None:
            self.bar.update(1)
        due = report.step % self.log_interval == 0 or report.is_last or report.eval
        if not due:
            return
        record = self._record(parts, report)
        self._final_loss = record["loss"]
        if self.writer is not None:
            self.writer.write(record)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{100 * record['mfu']:.1f}%",
                refresh=False,
            )

    def _record(self, parts: RunParts, report: StepReport) -> dict[str, Any]:
        seconds = max(report.process_train_seconds - self._last_seconds, 1e-9)
        tokens_per_s = (report.process_tokens - self._last_tokens) / seconds
        self._last_tokens, self._last_seconds = report.process_tokens, report.process_train_seconds
        record: dict[str, Any] = {
            "step": report.step,
            "loss": mean_over_ranks(report.loss),
            "lr": report.lr,
            "tokens": report.tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, parts.sizes.flops_per_token, parts.peak_flops,
                       parts.world_size),
            "grad_norm": float(report.grad_norm),
            "skipped_steps": self._skipped,
            "elapsed_s": report.process_train_seconds,
        }
        memory = peak_memory_bytes(parts.device)
        record["peak_mem_gib" if memory is not None else "peak_rss_gib"] = (
            memory if memory is not None else peak_rss_bytes()
        ) / 2**30
        if self._first:
            from densetrain.parallel.memory import rank_memory

            state = rank_memory(parts.model.module.parameters(), parts.optimizer)
            record["model_state_gib"] = state.total_bytes / 2**30
            self._first = False
        record.update(report.eval)
        return record

    def summary(self) -> dict[str, Any]:
        """The last logged training loss."""
        return {"final_loss": self._final_loss}

    def close(self) -> None:
        """Release files and the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Sampler(Callback):
    """A short greedy continuation of a prompt from the final model, printed by rank 0 (every
    rank takes part: a sharded or pipelined model needs them all)."""

    def __init__(self, *, prompt: str, max_new_tokens: int) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.sample = ""

    def on_train_end(self, parts: RunParts, progress: Progress) -> None:
        """Generate and print."""
        if self.prompt and self.max_new_tokens > 0:
            self.sample = sample_text(parts, self.prompt, self.max_new_tokens)

    def summary(self) -> dict[str, Any]:
        """The sample text."""
        return {"sample": self.sample}


class Checkpointer(Callback):
    """Saves the Stateful tree every ``interval`` steps and after the last step.

    [checkpoint call site] Saving goes through `densetrain.checkpoint.AsyncCheckpointer`
    (background writes when ``async_save``; at most one in flight); the final save and the save
    on a preemption signal (`on_preempt`) are waited for; `close` (called by `train` also after
    an exception) waits for a save still in flight.
    """

    def __init__(self, *, interval: int, keep_last: int, save_final: bool,
                 async_save: bool = False, timeout_s: float = 600.0) -> None:
        self.interval = interval
        self.keep_last = keep_last
        self.save_final = save_final
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.writer: Any = None

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Open the writer for the run's checkpoint directory."""
        from densetrain.checkpoint.async_save import AsyncCheckpointer

        self.writer = AsyncCheckpointer(
            parts.checkpoint_dir, config_toml=parts.config_toml, keep_last=self.keep_last,
            async_save=self.async_save, timeout_s=self.timeout_s,
        )

    def _save(self, parts: RunParts, progress: Progress, *, wait: bool = False) -> None:
        from densetrain.train.faults import check_state_finite

        state = parts.state_tree(progress)
        check_state_finite(state, progress.step)  # model, optimizer, anything with tensors
        self.writer.save(progress.step, state)
        if wait:
            self.writer.wait()

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """The checkpoints after the restored step were deleted; forget the newest one."""
        self.last_checkpoint = ""

    def on_step_end(self, parts: RunParts, progress: Progress, report: StepReport) -> None:
        """Save on the cadence."""
        if progress.step % self.interval == 0:
            self._save(parts, progress)

    def on_train_end(self, parts: RunParts, progress: Progress) -> None:
        """Save the final state (a step just saved is not saved again) and wait for it."""
        if self.save_final:
            self._save(parts, progress, wait=True)
        else:
            self.writer.wait()

    def on_preempt(self, parts: RunParts, progress: Progress) -> None:
        """A stop signal arrived: save this step and wait until it is complete."""
        self._save(parts, progress, wait=True)

    def summary(self) -> dict[str, Any]:
        """The newest complete checkpoint written by this process."""
        last = self.writer.last_path if self.writer is not None else None
        return {"checkpoint": str(last) if last is not None else ""}

    def flush(self) -> None:
        """Wait until a save still being written is complete."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """Wait for a save still in flight (also after an exception)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class LossPlot(Callback):
    """A loss-curve PNG (training and validation loss against tokens) at the end of the run."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def on_train_end(self, parts: RunParts, progress: Progress) -> None:
        """Write ``<run_dir>/loss.png`` on rank 0."""
        if parts.is_main:
            self.path = plot_loss_curve(parts.run_dir)

    def summary(self) -> dict[str, Any]:
        """The plot's path."""
        return {"plot": str(self.path) if self.path else ""}


def plot_loss_curve(run_dir: str | os.PathLike) -> Path | None:
    """Plot ``metrics.jsonl`` of ``run_dir`` to ``loss.png`` (atomically); None if no records."""
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["tokens"] for r in records], [r["loss"] for r in records], label="train")
    evals = [r for r in records if "val_loss" in r]
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{Path(run_dir).name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(run_dir) / "loss.png"
    tmp = path.with_name("loss.tmp.png")
    fig.savefig(tmp, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return path
