"""The thin trainer: build the run from a `JobConfig`, resume, loop over `train_step`.

`train(job)` is the library entry point behind ``densetrain train``. The loop is a dozen lines:
each step is `train_step` (step.py); the `FaultGuard` (faults.py) decides what the step means
(continue, roll back, stop) and the loop acts on that decision; evaluation runs on its cadence
inside the loop, so its result is part of the step's `StepReport`; logging, checkpoints, the
plot and the sample are callbacks (callbacks.py) that read the report. Every hook of the
`Callback` base is called on every callback, ``on_preempt`` included.

One job, as the code runs it (docs/architecture.md has the package map)::

    train(job)
      build_run(job)                                   train/setup.py
        init_distributed → ParallelDims → ParallelMesh   parallel/distributed.py, mesh.py
        build_data(job.data)                             data/bundle.py
        build_model(model_cfg, job.parallel, pmesh)      parallel/build.py
          meta Transformer → parallelize → to_empty → init_weights   (pp: per stage)
        build_optimizer(...) → TrainingOptimizer         parallel/parallelize.py, zero.py
        CheckpointSession over the parts               checkpoint/session.py
      acquire_run_lock, GoodputLedger, HangWatchdog,   checkpoint/lock.py, train/goodput.py,
        StragglerMonitor, PreemptionHandler              watchdog.py, stragglers.py,
                                                         checkpoint/preemption.py
      FaultGuard(job.faults, record=the session's)     train/faults.py, sdc.py
      resume(parts, progress)                          here; checkpoint/session.py, resume.py
      RunLoop.run: prepare_batch → train_step (replayed? → guard.note_replay) → scheduler
                → guard.after_step → Decision          train/step.py, replay.py, faults.py
                    CONTINUE
                    ROLL_BACK: flush callbacks → checkpoints.rollback(at_most)
                               → guard.rolled_back → callbacks' on_rollback; next step
                    STOP: raise the decision's RunFaultError
                → evaluate? → callbacks' on_step_end (checkpoint interval: fixed or auto)
                → preemption vote: stop? → callbacks' on_preempt; return
                                                       callbacks.py, auto_interval.py,
                                                       checkpoint/preemption.py
      summary.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from densetrain.config.job import JobConfig
from densetrain.errors import UserError, describe_error
from densetrain.parallel.distributed import collective_step
from densetrain.train.auto_interval import auto_interval
from densetrain.train.callbacks import Callback, Checkpointer, LossPlot, MetricsLogger, Sampler
from densetrain.train.evaluation import Evaluator
from densetrain.train.faults import Act, Decision, FaultGuard, build_replica_check
from densetrain.train.goodput import GoodputLedger
from densetrain.train.phases import PhaseTracker
from densetrain.train.replay import replayed_step
from densetrain.train.state import Progress, RunParts, StepReport
from densetrain.train.step import train_step
from densetrain.train.stragglers import StragglerMonitor, blocking_point
from densetrain.train.watchdog import HangWatchdog, start_watchdog


def default_callbacks(job: JobConfig) -> list[Callback]:
    """Logging, checkpoints, the sample and the plot, as the job's config asks."""
    callbacks: list[Callback] = [
        MetricsLogger(config=job.logging),
        Sampler(prompt=job.eval.sample_prompt, max_new_tokens=job.eval.sample_tokens,
                interval=job.logging.sample_interval,
                prompt_tokens=job.eval.sample_prompt_tokens,
                temperature=job.eval.sample_temperature, top_k=job.eval.sample_top_k,
                top_p=job.eval.sample_top_p, seed=job.training.seed),
    ]
    if job.checkpoint.enabled:
        callbacks.append(Checkpointer(interval=job.checkpoint.interval,
                                      save_final=job.checkpoint.save_final,
                                      on_save_error=job.checkpoint.on_save_error,
                                      auto=auto_interval(job.checkpoint)))
    if job.logging.plot:
        callbacks.append(LossPlot())
    return callbacks


class RunLoop:
    """Steps a built run until ``training.steps``, evaluating on the evaluator's cadence and
    calling the callbacks with each step's report and acting on the `FaultGuard`'s decision
    after each step. Keeps this process's own token and time totals (throughput is never
    computed from tokens another process trained)."""

    def __init__(self, parts: RunParts, progress: Progress, evaluator: Evaluator,
                 callbacks: Sequence[Callback], guard: FaultGuard,
                 watchdog: HangWatchdog | None = None, ledger: GoodputLedger | None = None,
                 stop: Any = None, stragglers: StragglerMonitor | None = None) -> None:
        self.parts = parts
        self.stop = stop
        """A `densetrain.checkpoint.PreemptionHandler` asked after each step (or None)."""
        self.progress = progress
        self.evaluator = evaluator
        self.guard = guard
        self.phases = PhaseTracker(watchdog, ledger, stragglers)
        self.callbacks = list(callbacks)
        self.process_tokens = 0
        self.process_train_seconds = 0.0
        self.last_val_loss = float("nan")

    def flush_callbacks(self) -> None:
        """Let every callback complete its background work (async checkpoint writes)."""
        for callback in self.callbacks:
            callback.flush()

    def run(self) -> None:
        """The loop."""
        parts, progress = self.parts, self.progress
        total_steps = parts.settings.steps
        self.guard.start(parts)
        for callback in self.callbacks:
            callback.on_train_start(parts, progress)
        while progress.step < total_steps:
            self.phases.begin(progress.step + 1)
            report = self.step(total_steps)
            self.phases.enter("fault checks")
            report.stragglers = self.phases.measure_stragglers(report.step)  # collective
            decision = self.guard.after_step(parts, progress, report)
            if decision.kind is Act.STOP:
                assert decision.error is not None
                raise decision.error
            if decision.kind is Act.ROLL_BACK:  # the step is void
                self.roll_back(decision)
                self.phases.rolled_back()
                for callback in self.callbacks:
                    callback.on_rollback(parts, progress)
                self.phases.end()
                continue
            if self.evaluator.due(report.step, total_steps):
                self.phases.enter("evaluation")
                report.eval = self.evaluator.evaluate(parts)
                self.last_val_loss = report.eval.get("val_loss", self.last_val_loss)
            self.phases.enter("callbacks")
            for callback in self.callbacks:
                callback.on_step_end(parts, progress, report)
            # [checkpoint call site] preemption: a SIGTERM/SIGINT on any rank -> save, stop.
            with blocking_point():  # the preemption vote is a collective
                stopping = self.stop is not None and self.stop.should_stop()
            if stopping:
                self.phases.stop()
                for callback in self.callbacks:
                    callback.on_preempt(parts, progress)
                return
            self.phases.end()
        self.phases.stop()  # the closing evaluation, checkpoint and sample are unwatched
        for callback in self.callbacks:
            callback.on_train_end(parts, progress)

    def roll_back(self, decision: Decision) -> None:
        """Act on a ROLL_BACK ``decision``: complete the callbacks' background work (a save
        in flight may be the checkpoint to load, or fail first), have the checkpoint session
        load the newest checkpoint of step <= ``decision.at_most`` (a refused decision only
        looks it up: the run stops either way, with the message the guard says), and tell the
        guard what was restored (it raises when nothing was)."""
        parts = self.parts
        session = parts.checkpoints
        if session is None:
            raise RuntimeError("a rollback needs the run's checkpoint session (parts.checkpoints)")
        self.flush_callbacks()
        target = (session.newest_at_most(decision.at_most) if decision.refused
                  else session.rollback(decision.at_most))
        self.guard.rolled_back(parts, decision, target)

    def step(self, total_steps: int) -> StepReport:
        """One optimizer step of the run and its report."""
        parts, progress = self.parts, self.progress
        start = time.perf_counter()
        global_batch = parts.batch_schedule.batch_size_at(progress.step)
        batch = parts.model.prepare_batch(parts.data.train.next_batch(global_batch), parts.device)
        self.phases.enter("step")
        step_args = dict(micro_batch_size=parts.settings.micro_batch_size,
                         grad_clip=parts.settings.grad_clip, autocast=parts.autocast,
                         nan_policy=parts.settings.nan_policy, step=progress.step + 1)
        with collective_step(progress.step + 1):  # a failed collective names rank and step
            if self.guard.replay_due(progress.step + 1):  # computed twice and compared
                output, mismatch = replayed_step(
                    parts.model, parts.optimizer, batch, **step_args,
                    tolerance=self.guard.config.sdc_replay_tolerance)
                self.guard.note_replay(mismatch)
            else:
                output = train_step(parts.model, parts.optimizer, batch, **step_args)
        lr = float(parts.optimizer.param_groups[0]["lr"])
        parts.scheduler.step()
        tokens = global_batch * parts.settings.seq_len
        progress.step += 1
        progress.tokens += tokens
        self.process_tokens += tokens
        elapsed = time.perf_counter() - start
        self.process_train_seconds += elapsed
        return StepReport(
            step=progress.step, total_steps=total_steps, loss=output.loss,
            grad_norm=output.grad_norm, skipped=output.skipped, lr=lr, tokens=progress.tokens,
            process_tokens=self.process_tokens, process_train_seconds=self.process_train_seconds,
            step_seconds=elapsed,
        )


def resume(parts: RunParts, progress: Progress, *, allow_config_change: bool = False) -> str:
    """Load the newest checkpoint that verifies into the run (if any); returns its path or "".

    [checkpoint call site] `CheckpointSession.resume` over ``parts.checkpoints`` (whose
    progress counters are ``progress``): damaged newer checkpoints are reported and set aside,
    the saved config is compared with the run's first (a changed model or data order is
    refused unless ``checkpoint.allow_config_change``), and so is the optimizer's layout.
    """
    session = parts.checkpoints
    assert session is not None and session.progress is progress, "train() builds the session"
    return session.resume(allow_config_change=allow_config_change,
                          vocab_size=parts.model_cfg.vocab_size, world_size=parts.world_size,
                          optimizer_layout=parts.optimizer.checkpoint_layout)


def summarize(parts: RunParts, progress: Progress, loop: RunLoop,
              callbacks: Sequence[Callback]) -> dict[str, Any]:
    """The run's summary (also written to ``summary.json``): throughput and MFU over this
    process's own tokens and time."""
    from densetrain.train.metrics import mfu_warning

    seconds = loop.process_train_seconds
    tokens_per_s = loop.process_tokens / seconds if seconds else 0.0
    run_mfu = parts.peak.mfu(tokens_per_s, parts.sizes.flops_per_token, parts.world_size,
                             step=progress.step)
    summary: dict[str, Any] = {
        "final_loss": float("nan"),
        "final_val_loss": loop.last_val_loss,
        "tokens": progress.tokens,
        "steps": progress.step,
        "params": parts.sizes.params,
        "non_embedding_params": parts.sizes.non_embedding_params,
        "flops": parts.sizes.flops_per_token * progress.tokens,
        "flops_per_token": parts.sizes.flops_per_token,
        "process_tokens": loop.process_tokens,
        "tokens_per_s": tokens_per_s,
        "mfu": run_mfu,
        "peak_flops_per_device": parts.peak_flops,
        "peak_flops_source": parts.peak_source,
        "peak": parts.peak.describe(),
        "world_size": parts.world_size,
        "train_seconds": seconds,
        "run_dir": str(parts.run_dir),
        "checkpoint": "",
        "plot": "",
        "sample": "",
    }
    warning = mfu_warning(run_mfu, parts.peak_flops, parts.peak_source)
    if warning:
        summary["mfu_warning"] = warning
    summary.update(loop.evaluator.summary())
    for callback in callbacks:
        summary.update(callback.summary())
    return summary


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically."""
    path = run_dir / "summary.json"
    tmp = path.with_name("summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def finished_run_summary(parts: RunParts, progress: Progress) -> dict[str, Any]:
    """The summary of a run resumed at or past its last step: the stored ``summary.json``
    (never rewritten: this process trained nothing) with ``already_finished`` set; rank 0
    says so in one line.

    A damaged ``summary.json`` (truncated, not JSON, not an object) does not block: it is
    derived data, and the run's state is its checkpoint, which just verified. It is not
    rewritten either: its numbers (loss, throughput, MFU, time) are those of the process that
    trained the last step and cannot be recomputed from the checkpoint, so a rewrite would put
    other, partly invented numbers under its name. The line says it is damaged and what it
    lacks; the returned summary holds the checkpoint's step and tokens.
    """
    from densetrain.models.hf.files import read_json

    path = parts.run_dir / "summary.json"
    stored: dict[str, Any] = {}
    note = "no summary.json was written by the run"
    if path.is_file():
        try:
            stored = read_json(path)
            note = f"summary {path} kept"
        except (UserError, OSError) as err:
            note = (f"summary {path} is damaged and left as it is ({describe_error(err)}; "
                    "derived data only: the checkpoint holds the run, metrics.jsonl its "
                    "losses, and training further writes a new summary)")
    if parts.is_main:
        print(f"densetrain train: the run in {parts.run_dir} is already finished (step "
              f"{progress.step} of training.steps={parts.settings.steps}); nothing trained, "
              f"{note}; raise --training.steps to train further", file=sys.stderr)
    return {**stored, "steps": progress.step, "tokens": progress.tokens,
            "run_dir": str(parts.run_dir), "already_finished": True}


def train(job: JobConfig, *, callbacks: Sequence[Callback] | None = None) -> dict[str, Any]:
    """Run the training job ``job`` and return its summary dict.

    Holds the run directory's lock for the whole run (a second run there fails at once).
    Resumes from the newest checkpoint that verifies when ``checkpoint.resume`` is on (damaged
    ones are set aside; a changed model or data order is refused). On SIGTERM/SIGINT it saves a
    checkpoint and returns early with ``summary["preempted"]`` set to the signal's name (no
    ``summary.json``: the run is not finished). A run resumed at its last step is already
    finished: nothing is trained or rewritten and the stored summary is returned with
    ``already_finished`` set (`finished_run_summary`). ``callbacks`` are added after the
    default ones (logging, checkpoints, sample, plot).
    """
    import torch.distributed as dist

    from densetrain.checkpoint.lock import acquire_run_lock
    from densetrain.checkpoint.preemption import PreemptionHandler
    from densetrain.train.inputs import check_job_inputs
    from densetrain.train.setup import _init_distributed, build_run

    # Data, run_dir, checkpoint dir, tokenizer vs model: refused before any work, in the same
    # line for the CLI and a Python caller (cheap, and safe on every rank: no group needed).
    check_job_inputs(job)
    started = time.time()
    owns_process_group = not (dist.is_available() and dist.is_initialized())
    all_callbacks = default_callbacks(job) + list(callbacks or [])
    lock = None
    parts: RunParts | None = None
    succeeded = False
    watchdog: HangWatchdog | None = None
    try:
        # [checkpoint call site] one run per directory, before any work (collective).
        _init_distributed(job)
        lock = acquire_run_lock(job.logging.run_dir)
        parts, progress = build_run(job)
        guard = FaultGuard(job.faults, replica_check=build_replica_check(
            job.faults, job.parallel, parts.pmesh), record=parts.fault_record)
        watchdog = start_watchdog(job.faults, rank=parts.rank, run_dir=parts.run_dir)
        ledger = GoodputLedger(parts.run_dir, write=parts.is_main, started=started)
        resumed_from = ""
        if job.checkpoint.resume and job.checkpoint.enabled:
            resumed_from = resume(
                parts, progress, allow_config_change=job.checkpoint.allow_config_change)
        if resumed_from and progress.step >= job.training.steps:
            summary = finished_run_summary(parts, progress)
            succeeded = True
            return summary
        stragglers = StragglerMonitor(job.faults, rank=parts.rank, world_size=parts.world_size,
                                      device=parts.device, is_main=parts.is_main)
        stragglers.attach(parts.model, parts.pmesh.dims if parts.pmesh is not None else None)
        # [checkpoint call site] SIGTERM/SIGINT -> save and stop, within the grace time.
        with PreemptionHandler(grace_s=job.checkpoint.preemption_grace_s,
                               timeout_s=job.parallel.collective_timeout_s) as preemption:
            loop = RunLoop(parts, progress,
                           Evaluator(interval=job.eval.interval,
                                     num_windows=job.eval.num_windows),
                           all_callbacks, guard, watchdog, ledger, stop=preemption,
                           stragglers=stragglers)
            loop.run()
        loop.phases.finish(progress.step)
        summary = summarize(parts, progress, loop, all_callbacks)
        summary.update(ledger.summary())
        summary.update(stragglers.summary())
        summary["resumed_from"] = resumed_from
        if preemption.requested:
            summary["preempted"] = preemption.signal_name
        elif parts.is_main:
            write_summary(parts.run_dir, summary)
        succeeded = True
    finally:
        if not succeeded:
            _defer_stop_signals()
        if watchdog is not None:
            watchdog.close()
        for callback in all_callbacks:
            callback.close()  # the Checkpointer waits for a save still in flight
        if parts is not None:
            parts.checkpoints.close()
        if lock is not None:
            lock.release()
        if owns_process_group:
            _shutdown_process_group(succeeded)
    return summary


def _defer_stop_signals() -> None:
    """From here on a SIGTERM/SIGINT is noted and ignored: the run is already ending with an
    error, and its cleanup and one-line report (a lost peer's name, exit 4) take milliseconds.
    Under torchrun the agent SIGTERMs the survivors of a failed group at once; with the default
    disposition they would die mid-cleanup without saying why. A process that does not end
    anyway is SIGKILLed by its launcher after its grace (torchrun: 30 s)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def note(signum: int, frame: Any) -> None:
        print(f"received {signal.Signals(signum).name} while ending after an error",
              file=sys.stderr, flush=True)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, note)


def _shutdown_process_group(succeeded: bool) -> None:
    """Destroy the process groups this process created, in an order that is safe at exit.

    [checkpoint call site] After a successful run every rank first waits for the others (a
    barrier), so no rank tears down its connections while a peer still writes its summary or
    plot (a peer that exits early makes torchrun stop the others mid-write). The checkpoint
    threads are already joined (`CheckpointSession.close`). After an error there is no barrier (a
    peer may be dead). Then every group is destroyed and the objects that still refer to them
    are collected while the interpreter is fully alive, not during its finalisation.
    """
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from densetrain.parallel.heartbeat import stop_heartbeat

    if succeeded:
        dist.barrier()
        stop_heartbeat()  # after an error it runs on: the error report reads the heartbeats
    dist.destroy_process_group()
    gc.collect()
