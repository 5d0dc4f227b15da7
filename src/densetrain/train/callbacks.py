"""Callbacks of the trainer: metrics logging and progress, checkpoints, the plot, the sample.

Each callback is built with its own settings and sees the run's built parts (`RunParts`), its
checkpointed progress and, after every step, that step's `StepReport` (evaluation included). The
`Callback` base declares every hook the loop calls, each doing nothing by default, and the loop
calls each hook on every callback: a callback overrides the ones it needs. No callback writes
into shared state, so their order does not matter; each may contribute entries to the run's
summary (`summary()`) and releases what it holds in `close()` (also after an exception).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from densetrain.config.sections import LoggingConfig
from densetrain.train.device import peak_memory_bytes, peak_rss_bytes
from densetrain.train.evaluation import (
    SampleSpec,
    mean_over_ranks,
    sample_text,
    validation_prompt,
)
from densetrain.train.loggers import (
    TENSORBOARD_MISSING,
    RecordSink,
    WandbSink,
    format_log_line,
    open_tensorboard,
    terminal_output,
)
from densetrain.train.metrics import MetricsWriter, mfu_warning, read_metrics
from densetrain.train.state import Progress, RunParts, StepReport

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class Callback:
    """Hooks called by the trainer; every hook runs on every rank (collectives are allowed)."""

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Called once, after resume, before the first step of this process."""

    def on_step_end(self, parts: RunParts, progress: Progress, report: StepReport) -> None:
        """Called after each optimizer step (``progress.step`` is the step just taken)."""

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """Called after the run was rolled back to an earlier checkpoint (``progress.step``
        is the step restored; the steps after it will be taken again)."""

    def on_preempt(self, parts: RunParts, progress: Progress) -> None:
        """Called once when a stop signal (SIGTERM/SIGINT on any rank) ends the run after the
        step ``progress.step``, instead of `on_train_end`."""

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
    """Every ``log_interval`` steps (and at evaluations and the last step): a metrics record
    to ``metrics.jsonl`` and the sinks (TensorBoard, W&B), and to the console: the progress bar
    when stdout and stderr are terminals and ``progress`` is on, else one plain line on stderr
    (no carriage-return redraws into a log file). The first record also holds the model-state
    bytes of each rank (parameters, gradients, optimizer states: ``parallel.memory.rank_memory``).
    An MFU above 100% is warned about once (the peak it divides by is too low)."""

    def __init__(self, *, config: LoggingConfig) -> None:
        self.config = config
        self.log_interval = config.log_interval
        self.writer: MetricsWriter | None = None
        self.bar = None
        self.line_log = False
        self._last_tokens = 0
        self._last_seconds = 0.0
        self._skipped = 0
        self._first = True
        self._final_loss = float("nan")
        self._val_loss = float("nan")
        self._mfu_warning = ""
        self._start = (0.0, 0)

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Open the metrics file (dropping lines after the resumed step), the sinks, and the
        progress bar or the line log."""
        self._start = (time.perf_counter(), progress.step)
        if not parts.is_main:
            return
        self.writer = MetricsWriter(parts.run_dir, resume_step=progress.step,
                                    sinks=self._open_sinks(parts, progress))
        if self.config.progress and terminal_output():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=parts.settings.steps, initial=progress.step, unit="step",
                            dynamic_ncols=True, file=sys.stderr, desc="train")
        else:
            self.line_log = True

    def _open_sinks(self, parts: RunParts, progress: Progress) -> list[RecordSink]:
        sinks: list[RecordSink] = []
        if self.config.tensorboard:
            board = open_tensorboard(parts.run_dir, resume_step=progress.step)
            if board is None:
                print(TENSORBOARD_MISSING, file=sys.stderr)
            else:
                sinks.append(board)
        if self.config.wandb:
            sinks.append(WandbSink(
                run_dir=parts.run_dir, project=self.config.wandb_project,
                name=self.config.wandb_name, directory=self.config.wandb_dir,
                mode=self.config.wandb_mode, config=tomllib.loads(parts.settings.config_toml)))
        return sinks

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """Drop the metrics of the undone steps (``faults.jsonl`` keeps the spike) and move
        the bar back."""
        if self.writer is not None:
            self.writer.rewind(progress.step)
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
        record = self._record(parts, report)  # a collective: every rank takes part
        self._final_loss = record["loss"]
        self._val_loss = record.get("val_loss", self._val_loss)
        if self.writer is None:
            return
        if parts.peak.step == report.step:
            self._say(f"MFU {parts.peak.describe()}: the earlier probe read low")
        self.writer.write(record)
        warning = mfu_warning(record["mfu"], parts.peak_flops, parts.peak_source)
        if warning and not self._mfu_warning:
            self._mfu_warning = warning
            self._say(f"warning: {warning}")
        self._show(record, report)

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def _show(self, record: dict[str, Any], report: StepReport) -> None:
        if self.bar is not None:
            postfix = {"loss": f"{record['loss']:.4f}"}
            if math.isfinite(self._val_loss):
                postfix["val"] = f"{self._val_loss:.4f}"
            postfix.update(lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}",
                           mfu=f"{100 * record['mfu']:.1f}%")
            self.bar.set_postfix(postfix, refresh=False)
        elif self.line_log:
            started, start_step = self._start
            done = report.step - start_step
            eta = ((time.perf_counter() - started) / done * (report.total_steps - report.step)
                   if done > 0 else math.nan)
            print(format_log_line(record, total_steps=report.total_steps,
                                  val_loss=self._val_loss, eta_s=eta),
                  file=sys.stderr, flush=True)

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
            "mfu": parts.peak.mfu(tokens_per_s, parts.sizes.flops_per_token, parts.world_size,
                                  step=report.step),
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
        if report.stragglers:
            record["stragglers"] = report.stragglers
        return record

    def summary(self) -> dict[str, Any]:
        """The last logged training loss (and the MFU warning, when one was given)."""
        entries: dict[str, Any] = {"final_loss": self._final_loss}
        if self._mfu_warning:
            entries["mfu_warning"] = self._mfu_warning
        return entries

    def close(self) -> None:
        """Release the files, the sinks and the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Sampler(Callback):
    """A short continuation of a prompt, printed by rank 0: every ``interval`` steps during
    training (0: never) and from the final model (every rank takes part: a sharded or
    pipelined model needs them all).

    The prompt is ``prompt`` or, when that is empty, the first ``prompt_tokens`` tokens of the
    validation split (`validation_prompt`, read at the start of training so that a run without
    validation data is refused before it trains). Drawn as ``spec`` says (`SampleSpec`:
    temperature, top-k, top-p and the seed; temperature 0 is greedy)."""

    def __init__(self, *, prompt: str, max_new_tokens: int, interval: int = 0,
                 prompt_tokens: int = 48, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> None:
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.interval = interval
        self.spec = SampleSpec(max_new_tokens=max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed)
        self.prompt_ids: list[int] = []
        self.prompt_text = prompt
        self.sample = ""
        self.samples: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        """True when there are tokens to generate."""
        return self.max_new_tokens > 0

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Resolve the prompt to token ids (from the validation split when ``prompt`` is
        empty)."""
        if not self.enabled:
            return
        tokenizer = parts.data.tokenizer
        if self.prompt:
            self.prompt_ids = tokenizer.encode(self.prompt) or [tokenizer.eos_id]
            self.prompt_text = self.prompt
        else:
            self.prompt_ids = validation_prompt(parts, self.prompt_tokens)
            self.prompt_text = tokenizer.decode(self.prompt_ids)

    def _generate(self, parts: RunParts, step: int) -> str:
        text = sample_text(parts, self.prompt_ids, self.spec)
        if parts.is_main:
            where = (f"eval.sample_prompt {self.prompt!r}" if self.prompt else
                     f"the first {len(self.prompt_ids)} tokens of the validation split")
            rule = "-" * 20
            print(f"sample at step {step} ({self.spec.describe()}) from {where}:\n"
                  f"{rule} prompt {rule}\n{self.prompt_text}\n"
                  f"{rule} continuation {rule}\n{text}\n{rule * 2}", file=sys.stderr)
        return text

    def on_step_end(self, parts: RunParts, progress: Progress, report: StepReport) -> None:
        """Generate on the cadence (the last step's sample comes from `on_train_end`)."""
        if self.enabled and self.interval and report.step % self.interval == 0 \
                and not report.is_last:
            text = self._generate(parts, report.step)
            self.samples.append({"step": report.step, "text": text})

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """Forget the samples of the undone steps."""
        self.samples = [s for s in self.samples if s["step"] <= progress.step]

    def on_train_end(self, parts: RunParts, progress: Progress) -> None:
        """Generate and print."""
        if self.enabled:
            self.sample = self._generate(parts, progress.step)

    def summary(self) -> dict[str, Any]:
        """The final sample text and its prompt (and, with an interval, the samples during
        training)."""
        entries: dict[str, Any] = {"sample": self.sample}
        if self.enabled:
            entries["sample_prompt"] = self.prompt_text
        if self.interval:
            entries["samples"] = self.samples
        return entries


class Checkpointer(Callback):
    """Saves the Stateful tree every ``interval`` steps and after the last step.

    [checkpoint call site] Saving goes through the run's `densetrain.checkpoint
    .CheckpointSession` (``parts.checkpoints``: background writes when ``checkpoint.async_save``;
    at most one in flight; pruning to ``checkpoint.keep_last``); the final save and the save on a
    preemption signal (`on_preempt`) are waited for; `close` (called by `train` also after an
    exception) waits for a save still in flight. A background save that has ended is collected
    after every step (all ranks agree first), so its failure is reported at the next step. A
    failed save (a full disk, say) then ends the run with one `CheckpointError` line
    (``on_save_error="stop"``) or prints one warning line and trains on, the next save being
    tried as usual (``"continue"``): that policy is the loop's, so it lives here.

    ``interval="auto"``: ``auto`` (an `AutoInterval`) chooses the cadence from the measured save
    stall, step time and failure history (checkpoint/interval.py).
    """

    def __init__(self, *, interval: int | str, save_final: bool, on_save_error: str = "stop",
                 auto: Any = None) -> None:
        self.interval = interval
        self.auto = auto
        self.save_final = save_final
        self.on_save_error = on_save_error
        self.failed_saves: list[str] = []
        """The message of every save that failed and was passed over (``"continue"``)."""
        self.session: Any = None
        self._is_main = True

    def on_train_start(self, parts: RunParts, progress: Progress) -> None:
        """Open the session's writer for the run's checkpoint directory."""
        self.session, self._is_main = parts.checkpoints, parts.is_main
        self.session.open()
        if self.auto is not None:
            self.auto.start(parts, progress.step)

    def _guarded(self, action: Any) -> None:
        """Run a session ``action``; a failed save stops the run or is reported and passed
        over, as ``on_save_error`` says (a state holding NaN/inf is never passed over)."""
        from densetrain.checkpoint import CheckpointError, NonFiniteStateError

        try:
            action()
        except NonFiniteStateError:
            raise
        except CheckpointError as err:
            if self.on_save_error == "stop":
                raise CheckpointError(
                    f"{err}; checkpoint.on_save_error='stop' ends the run (resume restarts from "
                    "the newest complete checkpoint)") from err
            self.failed_saves.append(str(err))
            if self._is_main:
                print(f"warning: {err}; checkpoint.on_save_error='continue': training goes on "
                      "and the next save is tried as usual", file=sys.stderr, flush=True)

    def _save(self, parts: RunParts, progress: Progress, *, wait: bool = False) -> None:
        self._guarded(self.session.wait)  # the previous save's failure, before this save
        self._guarded(lambda: self.session.save(progress.step, wait=wait))

    def _collect_settled(self) -> None:
        """Collect a background save that has ended on every rank (its failure is raised or
        reported now); a save still being written is left alone."""
        if self.session is None or not self.session.has_pending:
            return
        if self.session.settled_everywhere():  # every rank collects at the same step
            self._guarded(self.session.wait)

    def on_rollback(self, parts: RunParts, progress: Progress) -> None:
        """The checkpoints after the restored step were deleted: the automatic interval counts
        from the restored step."""
        if self.auto is not None:
            self.auto.rolled_back(progress.step)

    def on_step_end(self, parts: RunParts, progress: Progress, report: StepReport) -> None:
        """Report a background save that ended; save on the cadence."""
        if self.auto is not None:
            self._auto_step(parts, progress)
            return
        self._collect_settled()
        if progress.step % self.interval == 0:
            self._save(parts, progress)

    def _auto_step(self, parts: RunParts, progress: Progress) -> None:
        """`on_step_end` of ``interval="auto"``: the stall of a cadence save is timed (all of
        this hook's time the loop is blocked) and the interval decided again."""
        self.auto.iteration_started()
        self._collect_settled()
        if self.auto.due(progress.step):
            start = time.perf_counter()
            self._save(parts, progress)
            self.auto.saved(progress.step, time.perf_counter() - start)
        self.auto.iteration_ended()

    def on_train_end(self, parts: RunParts, progress: Progress) -> None:
        """Save the final state (a step just saved is not saved again) and wait for it."""
        if self.save_final:
            self._save(parts, progress, wait=True)
        else:
            self._guarded(self.session.wait)
        if self.auto is not None:
            self.auto.end("finished")

    def on_preempt(self, parts: RunParts, progress: Progress) -> None:
        """A stop signal arrived: save this step and wait until it is complete."""
        self._save(parts, progress, wait=True)
        if self.auto is not None:
            self.auto.end("preempted")

    def summary(self) -> dict[str, Any]:
        """The newest complete checkpoint written by this process."""
        last = self.session.last_path if self.session is not None else None
        entries = {"checkpoint": str(last) if last is not None else ""}
        if self.auto is not None:
            entries.update(self.auto.summary())
        return entries

    def flush(self) -> None:
        """Wait until a save still being written is complete."""
        if self.session is not None:
            self._guarded(self.session.wait)

    def close(self) -> None:
        """Wait for a save still in flight (also after an exception)."""
        if self.session is not None:
            self.session.close()
            self.session = None


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
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["tokens"] for r in records], [r["loss"] for r in records], label="train")
    evals = [r for r in records if "val_loss" in r]
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, 1.2M: no "1e6" offset
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
