"""The thin trainer: build everything from a `JobConfig`, resume, loop over `train_step`.

`train(job)` is the library entry point behind ``densetrain train``. The loop itself is a dozen
lines; logging, MFU, progress, evaluation, checkpoints, the plot and the sample are callbacks
(callbacks.py), and the one optimizer step is `train_step` (step.py).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densetrain.checkpoint import (
    ModelState,
    OptimizerState,
    RNGState,
    TrainerCounters,
    load_checkpoint,
    save_checkpoint,
)
from densetrain.train.callbacks import (
    Callback,
    Checkpointer,
    Evaluator,
    LossPlot,
    MetricsLogger,
    Sampler,
)
from densetrain.train.step import StepOutput, split_micro_batches, train_step


@dataclass(kw_only=True)
class RunState:
    """Everything a run holds, shared by the loop and the callbacks."""

    job: Any
    model: torch.nn.Module
    inner_model: torch.nn.Module
    model_cfg: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batch_schedule: Any
    data: Any
    device: torch.device
    autocast: Callable[[], AbstractContextManager[None]]
    loss_fn: Callable[[torch.nn.Module, Any], Any]
    clip_grad_norm: Callable[[Any, float], torch.Tensor]
    counters: TrainerCounters
    rank: int
    world_size: int
    dp_size: int
    run_dir: Path
    checkpoint_dir: Path
    total_steps: int
    flops_per_token: float
    peak_flops: float
    peak_source: str
    params: int
    non_embedding_params: int
    config_toml: str
    cp_size: int = 1
    """Context-parallel degree: each rank of a cp group holds 1/cp of every sequence."""
    cp_rank: int = 0
    cp_group: Any = None
    """The process group of this rank's cp peers (None when cp = 1)."""
    pp_group: Any = None
    """The process group of this rank's pipeline stages (None when pp = 1)."""
    start_time: float = field(default_factory=time.perf_counter)
    train_seconds: float = 0.0
    last_train_loss: float = float("nan")
    last_val_loss: float = float("nan")
    eval_record: dict[str, float] = field(default_factory=dict)
    resumed_from: str = ""
    last_checkpoint: str = ""
    plot_path: Path | None = None
    sample: str = ""

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the one that prints and writes run files)."""
        return self.rank == 0

    def state_tree(self) -> dict[str, Any]:
        """The Stateful tree one checkpoint covers."""
        return {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optimizer),
            "lr_schedule": self.scheduler,
            "batch_schedule": self.batch_schedule,
            "data": self.data.train,
            "rng": RNGState(),
            "trainer": self.counters,
        }

    def to_device(self, batch: Any) -> Any:
        """A copy of ``batch`` (a dataclass of tensors) on the run's device."""
        moved = {
            k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in vars(batch).items()
        }
        return type(batch)(**moved)

    def prepare_batch(self, batch: Any) -> Any:
        """``batch`` on the device; with context parallel, this rank's load-balanced share of
        every sequence (`parallel.context.shard_sequence`) with its global positions."""
        batch = self.to_device(batch)
        if self.cp_size == 1:
            return batch
        from densetrain.parallel.context import shard_sequence

        if batch.document_ids is not None:
            raise ValueError(
                f"parallel.cp={self.cp_size} supports the plain causal mask only; turn off "
                "document masking in the data config"
            )
        rows, seq_len = batch.inputs.shape
        positions_BS = batch.positions
        if positions_BS is None:
            positions_BS = torch.arange(seq_len, device=self.device).expand(rows, seq_len)
        return type(batch)(
            inputs=shard_sequence(batch.inputs, self.cp_rank, self.cp_size),
            targets=shard_sequence(batch.targets, self.cp_rank, self.cp_size),
            positions=shard_sequence(positions_BS, self.cp_rank, self.cp_size),
            document_ids=None,
        )

    def save_checkpoint(self, keep_last: int) -> Path:
        """Save the state tree as ``step-<step>`` under the checkpoint directory."""
        path = save_checkpoint(
            self.checkpoint_dir,
            self.counters.step,
            self.state_tree(),
            config_toml=self.config_toml,
            keep_last=keep_last,
        )
        self.last_checkpoint = str(path)
        return path


def default_callbacks(job: Any) -> list[Callback]:
    """Evaluation, logging, checkpoints and the plot, as the job's config asks."""
    callbacks: list[Callback] = [
        Evaluator(interval=job.eval.interval, num_batches=job.eval.num_batches),
        MetricsLogger(
            log_interval=job.logging.log_interval,
            tensorboard=job.logging.tensorboard,
            progress=job.logging.progress,
        ),
        Sampler(prompt=job.eval.sample_prompt, max_new_tokens=job.eval.sample_tokens),
    ]
    if job.checkpoint.enabled:
        callbacks.append(
            Checkpointer(
                interval=job.checkpoint.interval,
                keep_last=job.checkpoint.keep_last,
                save_final=job.checkpoint.save_final,
                async_save=job.checkpoint.async_save,
            )
        )
    if job.logging.plot:
        callbacks.append(LossPlot())
    return callbacks


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_loop(run: RunState, callbacks: Sequence[Callback], stop: Any = None) -> None:
    """Step until ``run.total_steps``, calling the callbacks around each step.

    ``stop`` (a `densetrain.checkpoint.PreemptionHandler`) is asked after each step; when it
    says stop, the checkpointer saves that step and the loop returns without the end hooks.
    """
    job = run.job
    for callback in callbacks:
        callback.on_train_start(run)
    while run.counters.step < run.total_steps:
        start = time.perf_counter()
        global_batch = run.batch_schedule.batch_size_at(run.counters.step)
        batch = run.prepare_batch(run.data.train.next_batch(global_batch))
        output = _one_step(run, batch)
        run.scheduler.step()
        run.counters.step += 1
        run.counters.tokens += global_batch * job.data.seq_len
        run.train_seconds += time.perf_counter() - start
        for callback in callbacks:
            callback.on_step_end(run, output)
        # [checkpoint call site] preemption: a SIGTERM/SIGINT on any rank -> save, then stop.
        if stop is not None and stop.should_stop():
            for callback in callbacks:
                if isinstance(callback, Checkpointer):
                    callback.on_preempt(run)
            return
    for callback in callbacks:
        callback.on_train_end(run)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s per-parameter state (moments, step) without changing parameters.

    A checkpoint load fills the entries of the live state dict, so a fresh optimizer must have
    them first. ``get_optimizer_state_dict`` does this for plain optimizers; the ZeRO-1/2 wrapper
    saves its inner optimizer's state directly, so it is done here: one step on zero gradients
    with the learning rate set to 0 (AdamW's decoupled decay is scaled by lr, so 0 too).
    """
    if optimizer.state:
        return
    saved_lrs = []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def check_optimizer_layout(path: Path, run: RunState) -> None:
    """Refuse a checkpoint whose optimizer state was saved per rank (ZeRO-1/2) on another number
    of ranks, or saved per rank while this run's optimizer is not (and vice versa).

    ZeRO-1/2 states are this rank's flat chunks, which are not resharded on load.
    """
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "optim.rank"
    saved_ranks = {k[len(prefix):].split(".", 1)[0] for k in stored if k.startswith(prefix)}
    per_rank_now = not isinstance(run.optimizer, torch.optim.Optimizer)
    if not saved_ranks and not per_rank_now:
        return
    if per_rank_now and len(saved_ranks) == run.world_size:
        return
    saved = f"ZeRO-1/2 on world size {len(saved_ranks)}" if saved_ranks else (
        "a layout-independent optimizer (zero_stage 3 or one process)")
    now = (f"ZeRO-1/2 on world size {run.world_size}" if per_rank_now
           else f"parallel.zero_stage={run.job.parallel.zero_stage} on world size "
           f"{run.world_size}")
    raise ValueError(
        f"checkpoint {path} holds optimizer states of {saved}, but this run uses {now}: ZeRO-1/2 "
        "optimizer states are not resharded, so resume it with the same parallel.zero_stage and "
        "world size (or set checkpoint.resume=false and training.init_from to take the weights "
        "only)"
    )


def _one_step(run: RunState, batch: Any) -> StepOutput:
    """One optimizer step on the rank's ``batch``: through the pipeline schedule (pp > 1) or
    by gradient accumulation over micro-batches."""
    job = run.job
    common = dict(clip_grad_norm=run.clip_grad_norm, grad_clip=job.optim.grad_clip,
                  nan_policy=job.training.nan_policy, step=run.counters.step + 1,
                  ignore_index=run.model_cfg.ignore_index)
    if run.pp_group is not None:
        from densetrain.train.pipelined import pipeline_step

        with run.autocast():
            return pipeline_step(run.model, run.optimizer, batch, pp_group=run.pp_group,
                                 **common)
    return train_step(
        run.model, run.optimizer, split_micro_batches(batch, job.training.micro_batch_size),
        loss_fn=run.loss_fn, autocast=run.autocast, cp_group=run.cp_group, **common,
    )


def summarize(run: RunState) -> dict[str, Any]:
    """The run's summary (also written to ``summary.json``)."""
    tokens_per_s = run.counters.tokens / run.train_seconds if run.train_seconds else 0.0
    from densetrain.train.metrics import mfu

    return {
        "final_loss": run.last_train_loss,
        "final_val_loss": run.last_val_loss,
        "tokens": run.counters.tokens,
        "steps": run.counters.step,
        "params": run.params,
        "non_embedding_params": run.non_embedding_params,
        "flops": run.flops_per_token * run.counters.tokens,
        "flops_per_token": run.flops_per_token,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, run.flops_per_token, run.peak_flops, run.world_size),
        "peak_flops_per_device": run.peak_flops,
        "peak_flops_source": run.peak_source,
        "world_size": run.world_size,
        "train_seconds": run.train_seconds,
        "run_dir": str(run.run_dir),
        "checkpoint": run.last_checkpoint,
        "resumed_from": run.resumed_from,
        "plot": str(run.plot_path) if run.plot_path else "",
        "sample": run.sample,
    }


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically."""
    path = run_dir / "summary.json"
    tmp = path.with_name("summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def train(job: Any, *, callbacks: Sequence[Callback] | None = None) -> dict[str, Any]:
    """Run the training job ``job`` (a `JobConfig`) and return its summary dict.

    Holds the run directory's lock for the whole run (a second run there fails at once).
    Resumes from the newest checkpoint that verifies when ``checkpoint.resume`` is on (damaged
    ones are set aside; a changed model or data order is refused). On SIGTERM/SIGINT it saves a
    checkpoint and returns early with ``summary["preempted"]`` set to the signal's name.
    ``callbacks`` are added after the default ones (evaluation, logging, checkpoints, plot).
    """
    import torch.distributed as dist

    from densetrain.checkpoint.lock import acquire_run_lock
    from densetrain.checkpoint.preemption import PreemptionHandler
    from densetrain.train.setup import _init_distributed, build_run

    owns_process_group = not (dist.is_available() and dist.is_initialized())
    all_callbacks = default_callbacks(job) + list(callbacks or [])
    lock = None
    succeeded = False
    try:
        # [checkpoint call site] one run per directory, before any work (collective).
        _init_distributed(job)
        lock = acquire_run_lock(job.logging.run_dir)
        run = build_run(job)
        if job.checkpoint.resume and job.checkpoint.enabled:
            _resume(run)  # [checkpoint call site] verified resume with the config check
        # [checkpoint call site] SIGTERM/SIGINT -> save and stop, within the grace time.
        with PreemptionHandler(grace_s=job.checkpoint.preemption_grace_s,
                               timeout_s=job.parallel.collective_timeout_s) as preemption:
            run_loop(run, all_callbacks, stop=preemption)
        summary = summarize(run)
        if preemption.requested:
            summary["preempted"] = preemption.signal_name
        elif run.is_main:
            write_summary(run.run_dir, summary)
        succeeded = True
    finally:
        for callback in all_callbacks:
            if isinstance(callback, (MetricsLogger, Checkpointer)):
                callback.close()  # [checkpoint call site] Checkpointer waits for a save
        if lock is not None:
            lock.release()
        if owns_process_group:
            _shutdown_process_group(succeeded)
    return summary


def _resume(run: RunState) -> None:
    """Load the newest verified checkpoint, if any, after checking the config against it."""
    from densetrain.checkpoint.resume import check_resume_config, select_resume_checkpoint

    latest = select_resume_checkpoint(run.checkpoint_dir, run_dir=run.run_dir)
    if latest is None:
        return
    check_resume_config(latest, run.config_toml,
                        allow_change=run.job.checkpoint.allow_config_change,
                        run_dir=run.run_dir, vocab_size=run.model_cfg.vocab_size)
    check_optimizer_layout(latest, run)
    if not isinstance(run.optimizer, torch.optim.Optimizer):
        init_optimizer_state(run.optimizer.optimizer)
    load_checkpoint(latest, run.state_tree(), verify=False)  # verified just above
    if hasattr(run.optimizer, "reload_params"):  # ZeRO-1/2 master chunks
        run.optimizer.reload_params()
    run.resumed_from = str(latest)
    if run.is_main:
        print(f"resumed from {latest} (step {run.counters.step})", file=sys.stderr)


def _shutdown_process_group(succeeded: bool) -> None:
    """Destroy the process groups this process created, in an order that is safe at exit.

    After a successful run every rank first waits for the others (a barrier), so no rank
    tears down its gloo/NCCL connections while a peer still writes its summary or plot; a
    peer that exits early would otherwise make torchrun stop the others mid-write. The
    checkpoint threads are already joined (`Checkpointer.close`). After an error there is no
    barrier (a peer may be dead). Then every group is destroyed and the objects that still
    refer to them (meshes, FSDP state) are collected while the interpreter is fully alive,
    not during its finalisation.
    """
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if succeeded:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
