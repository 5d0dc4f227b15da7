"""Callbacks of the trainer: metrics logging and progress, evaluation and sample, checkpoints, plot.

Each callback sees the shared `RunState` (see trainer.py) and may act at the start of training,
after every step and at the end. The step function itself never logs, evaluates or saves.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from densetrain.train.device import peak_memory_bytes, peak_rss_bytes
from densetrain.train.metrics import MetricsWriter, mfu, read_metrics
from densetrain.train.step import StepOutput

if TYPE_CHECKING:
    from densetrain.train.trainer import RunState


class Callback:
    """Hooks called by the trainer; every hook runs on every rank (collectives are allowed)."""

    def on_train_start(self, run: RunState) -> None:
        """Called once, after resume, before the first step of this process."""

    def on_step_end(self, run: RunState, output: StepOutput) -> None:
        """Called after each optimizer step (``run.counters.step`` is the step just taken)."""

    def on_train_end(self, run: RunState) -> None:
        """Called once after the last step (not after an exception)."""


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


class MetricsLogger(Callback):
    """Every ``log_interval`` steps (and at evaluations): a metrics line, TensorBoard, progress."""

    def __init__(self, *, log_interval: int, tensorboard: bool, progress: bool) -> None:
        self.log_interval = log_interval
        self.tensorboard = tensorboard
        self.progress = progress
        self.writer: MetricsWriter | None = None
        self.bar = None
        self._last_tokens = 0
        self._last_seconds = 0.0
        self._skipped = 0

    def on_train_start(self, run: RunState) -> None:
        """Open the metrics file (dropping lines after the resumed step) and the progress bar."""
        if run.is_main:
            self.writer = MetricsWriter(
                run.run_dir, tensorboard=self.tensorboard, resume_step=run.counters.step
            )
        self._last_tokens = run.counters.tokens
        self._last_seconds = run.train_seconds
        if run.is_main and self.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=run.total_steps, initial=run.counters.step, unit="step", dynamic_ncols=True,
                file=sys.stderr, desc="train",
            )

    def on_step_end(self, run: RunState, output: StepOutput) -> None:
        """Write a record at log steps, at evaluation steps and at the last step."""
        self._skipped += int(output.skipped)
        step = run.counters.step
        if self.bar is not None:
            self.bar.update(1)
        due = step % self.log_interval == 0 or step == run.total_steps or run.eval_record
        if not due:
            return
        record = self._record(run, output)
        run.last_train_loss = record["loss"]
        if self.writer is not None:
            self.writer.write(record)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{100 * record['mfu']:.1f}%",
                refresh=False,
            )

    def _record(self, run: RunState, output: StepOutput) -> dict[str, Any]:
        seconds = max(run.train_seconds - self._last_seconds, 1e-9)
        tokens_per_s = (run.counters.tokens - self._last_tokens) / seconds
        self._last_tokens, self._last_seconds = run.counters.tokens, run.train_seconds
        record: dict[str, Any] = {
            "step": run.counters.step,
            "loss": _mean_over_ranks(output.loss),
            "lr": float(run.optimizer.param_groups[0]["lr"]),
            "tokens": run.counters.tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, run.flops_per_token, run.peak_flops, run.world_size),
            "grad_norm": float(output.grad_norm),
            "skipped_steps": self._skipped,
            "elapsed_s": time.perf_counter() - run.start_time,
        }
        memory = peak_memory_bytes(run.device)
        record["peak_mem_gib" if memory is not None else "peak_rss_gib"] = (
            memory if memory is not None else peak_rss_bytes()
        ) / 2**30
        if run.eval_record:
            record.update(run.eval_record)
            run.eval_record = {}
        return record

    def on_train_end(self, run: RunState) -> None:
        """Close the bar and the files."""
        self.close()

    def close(self) -> None:
        """Release files and the bar (also after an exception)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Evaluator(Callback):
    """Validation loss and perplexity every ``interval`` steps and after the last step."""

    def __init__(self, *, interval: int, num_batches: int) -> None:
        self.interval = interval
        self.num_batches = num_batches
        self._noted = False

    def on_step_end(self, run: RunState, output: StepOutput) -> None:
        """Evaluate on the cadence (and at the last step)."""
        step = run.counters.step
        if self.interval > 0 and (step % self.interval == 0 or step == run.total_steps):
            self.evaluate(run)

    def on_train_end(self, run: RunState) -> None:
        """Evaluate when no step of this process did (a resumed, already finished run)."""
        if self.interval > 0 and math.isnan(run.last_val_loss):
            self.evaluate(run)
            run.eval_record = {}

    @torch.no_grad()
    def evaluate(self, run: RunState) -> None:
        """Mean validation loss over the fixed validation batches into ``run.eval_record``."""
        if run.data.val is None:
            return
        if run.pp_group is not None:
            if run.is_main and not self._noted:
                print(f"evaluation skipped: the validation loss is not computed under "
                      f"parallel.pp={run.job.parallel.pp}", file=sys.stderr)
            self._noted = True
            return
        run.model.eval()
        batch_size = run.job.training.micro_batch_size * run.dp_size
        total = torch.zeros((), device=run.device)
        for batch in run.data.val.iter_eval(self.num_batches, batch_size):
            with run.autocast():
                total += run.loss_fn(run.model, run.prepare_batch(batch)).ce_loss.float()
        run.model.train()
        val_loss = _mean_over_ranks(total / self.num_batches)
        run.last_val_loss = val_loss
        run.eval_record = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


class Sampler(Callback):
    """A short greedy continuation of a prompt from the final model, printed by rank 0."""

    def __init__(self, *, prompt: str, max_new_tokens: int) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens

    def on_train_end(self, run: RunState) -> None:
        """Generate (every rank takes part: a sharded model needs them all) and print."""
        if self.prompt and self.max_new_tokens > 0:
            parallel = run.job.parallel
            if parallel.cp > 1 or parallel.pp > 1 or parallel.tp > 1:
                if run.is_main:
                    print(f"sample skipped: generation runs with parallel.tp, cp and pp all 1 "
                          f"(got tp={parallel.tp}, cp={parallel.cp}, pp={parallel.pp})",
                          file=sys.stderr)
                return
            run.sample = sample_text(run, self.prompt, self.max_new_tokens)
            if run.is_main:
                print(f"sample (greedy) | {self.prompt!r} ->\n{self.prompt}{run.sample}\n",
                      file=sys.stderr)


@torch.no_grad()
def sample_text(run: RunState, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` by the run's model (KV-cached `generate`)."""
    from densetrain.generate import generate

    tokenizer = run.data.tokenizer
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    tokens_1S = torch.tensor([ids], dtype=torch.long, device=run.device)
    model = run.inner_model
    model.eval()
    try:
        with run.autocast():
            out_1T = generate(model, tokens_1S, max_new_tokens, eos_token_id=tokenizer.eos_id)
    finally:
        model.train()
    return tokenizer.decode(out_1T[0, len(ids) :].tolist())


class Checkpointer(Callback):
    """Saves the Stateful tree every ``interval`` steps and after the last step.

    [checkpoint call site] Saving goes through `densetrain.checkpoint.AsyncCheckpointer`
    (background writes when ``async_save``; at most one in flight); the final save and the save
    on a preemption signal are waited for; `close` (called by `train` also after an exception)
    waits for a save still in flight.
    """

    def __init__(self, *, interval: int, keep_last: int, save_final: bool,
                 async_save: bool = False) -> None:
        self.interval = interval
        self.keep_last = keep_last
        self.save_final = save_final
        self.async_save = async_save
        self.writer: Any = None

    def on_train_start(self, run: RunState) -> None:
        """Open the writer for the run's checkpoint directory."""
        from densetrain.checkpoint.async_save import AsyncCheckpointer

        self.writer = AsyncCheckpointer(
            run.checkpoint_dir, config_toml=run.config_toml, keep_last=self.keep_last,
            async_save=self.async_save, timeout_s=run.job.parallel.collective_timeout_s,
        )

    def save(self, run: RunState, *, wait: bool = False) -> None:
        """Save the current step (and wait for it to be complete when ``wait``)."""
        self.writer.save(run.counters.step, run.state_tree())
        if wait:
            self.writer.wait()
        if self.writer.last_path is not None:
            run.last_checkpoint = str(self.writer.last_path)

    def on_step_end(self, run: RunState, output: StepOutput) -> None:
        """Save on the cadence."""
        if run.counters.step % self.interval == 0:
            self.save(run)

    def on_train_end(self, run: RunState) -> None:
        """Save the final state and wait until every save is complete."""
        if self.save_final:
            self.save(run, wait=True)
        else:
            self.writer.wait()
        if self.writer.last_path is not None:
            run.last_checkpoint = str(self.writer.last_path)

    def on_preempt(self, run: RunState) -> None:
        """A stop signal arrived: save this step and wait for it."""
        self.save(run, wait=True)

    def close(self) -> None:
        """Wait for a save still in flight (also after an exception)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class LossPlot(Callback):
    """A loss-curve PNG (training and validation loss against tokens) at the end of the run."""

    def on_train_end(self, run: RunState) -> None:
        """Write ``<run_dir>/loss.png`` on rank 0."""
        if run.is_main:
            run.plot_path = plot_loss_curve(run.run_dir)


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
