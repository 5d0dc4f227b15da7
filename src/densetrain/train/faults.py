"""Faults that do not crash a run but ruin it: non-finite steps past a cap, loss spikes,
early divergence and corrupted replicas.

`FaultGuard.after_step` runs in the loop after every step, before evaluation and callbacks (so a
spiking step is never checkpointed), and returns a `Decision`: CONTINUE, ROLL_BACK or STOP. It
decides and records what it saw; it loads nothing. The loop (train/trainer.py `RunLoop`) acts:

- ROLL_BACK, as PaLM §5.1 did, in the same process: the loop completes the callbacks'
  background work (an async save in flight may be the checkpoint to load), asks the run's
  `CheckpointSession` for the newest complete checkpoint of step <= ``Decision.at_most``
  (``faults.rollback_min_steps`` before the spike), which it loads, and hands what was restored
  to `FaultGuard.rolled_back`: the next ``faults.rollback_skip_batches`` batches of the
  deterministic data order are skipped, the rollback is recorded, the spike detector forgets
  the undone steps. Then the callbacks' ``on_rollback`` run.
- STOP: the loop raises ``Decision.error`` (`RunFaultError`, or `SilentDataCorruptionError`).

The skipped ranges live in the guard's `FaultRecord` (an entry of the checkpointed state tree)
and in ``<run_dir>/faults.jsonl``, so a later resume skips the same batches. Caps (skipped steps,
rollbacks within a window) end the run. Before the spike detector arms
(``faults.spike_warmup_steps``), a loss more than ``faults.divergence_margin`` nats above the
initial loss, or a non-finite one, is handled as a spike: the early divergence of a learning
rate far too high; without a checkpoint to go back to, the run stops with advice (that
message wins over the rollback cap's). `check_state_finite` refuses to save a state tree
holding NaN/inf anywhere (model, optimizer, anything with tensors).
"""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from densetrain.checkpoint.saving import check_state_finite, first_non_finite  # noqa: F401
from densetrain.config.sections import FaultsConfig, parse_sequence_ranges
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.mesh import ParallelMesh
from densetrain.train.evaluation import mean_over_ranks
from densetrain.train.fault_record import FaultRecord, append_history
from densetrain.train.sdc import ReplicaCheck, replica_axis
from densetrain.train.spikes import Spike, SpikeDetector
from densetrain.train.state import Progress, RunParts, StepReport
from densetrain.train.step import NonFiniteLossError


class RunFaultError(NonFiniteLossError):
    """The run stopped on a numerical fault: non-finite steps or loss spikes past their caps,
    or corrupted replicas."""


class SilentDataCorruptionError(RunFaultError):
    """Data-parallel replicas disagree bit for bit (``faults.sdc_action="stop"``)."""


class Act(enum.Enum):
    """What the loop does after a step (`Decision.kind`)."""

    CONTINUE = "continue"
    ROLL_BACK = "roll back"
    STOP = "stop"


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The guard's verdict on the step just taken (see the module docstring)."""

    kind: Act
    reason: str = ""
    """Why (ROLL_BACK: the history event's and the printed line's reason)."""
    spike_step: int = 0
    """ROLL_BACK: the step the fault showed at (the rollback cap counts these)."""
    at_most: int = 0
    """ROLL_BACK: load the newest complete checkpoint of step <= this."""
    spike: Spike | None = None
    """ROLL_BACK for a loss spike: the detector's numbers (recorded with the rollback)."""
    missing: str = ""
    """ROLL_BACK: the `RunFaultError` message when there is no checkpoint of step <= at_most."""
    refused: str = ""
    """ROLL_BACK of a divergence past the rollback cap: the run stops with this message once a
    checkpoint is known to exist (without one, `missing` is the message); nothing is loaded."""
    error: RunFaultError | None = None
    """STOP: the exception the loop raises."""

    @property
    def rolls_back(self) -> bool:
        """True for ROLL_BACK (the step's report is void)."""
        return self.kind is Act.ROLL_BACK


CONTINUE = Decision(kind=Act.CONTINUE)


def stop(error: RunFaultError) -> Decision:
    """A STOP decision raising ``error``."""
    return Decision(kind=Act.STOP, reason=str(error), error=error)


def build_replica_check(config: FaultsConfig, parallel: ParallelConfig, pmesh: ParallelMesh
                        ) -> ReplicaCheck | None:
    """The job's cross-replica check, or None (off, or no replicas in this layout)."""
    axis = replica_axis(pmesh, parallel)
    if config.sdc_check_interval == 0 or axis is None or pmesh.group(axis) is None:
        return None
    return ReplicaCheck(pmesh, axis, optimizer_states=config.sdc_check_optimizer)


def skipped_range(parts: RunParts, from_step: int, batches: int) -> tuple[int, int]:
    """Global sequence positions of the ``batches`` batches after step ``from_step`` (the
    data stream's position just after loading that step's checkpoint)."""
    start = parts.data.train.next_start(parts.batch_schedule.batch_size_at(from_step))
    count = sum(parts.batch_schedule.batch_size_at(s)
                for s in range(from_step, from_step + batches))
    return start, start + count


class FaultGuard:
    """The loop's check after each step: non-finite caps, loss spikes, divergence and replica
    checks → a `Decision`. Owns the run's `FaultRecord` (``record``: skipped steps, rollbacks,
    skipped data ranges), which the checkpoint session saves as the ``faults`` entry."""

    def __init__(self, config: FaultsConfig, *, replica_check: ReplicaCheck | None = None,
                 record: FaultRecord | None = None) -> None:
        self.config = config
        self.replica_check = replica_check
        self.record = record if record is not None else FaultRecord()
        self.last_good_check = 0
        """Step of the newest replica check or replay that passed (0: the start)."""
        self._replay_mismatch: str | None = None
        self.consecutive_skips = 0
        self.detector = SpikeDetector(
            window=config.spike_window, threshold=config.spike_threshold,
            min_deviation=config.spike_min_deviation, warmup_steps=config.spike_warmup_steps,
            min_history=config.spike_min_history,
        ) if config.spike_detection else None
        self.initial_loss: float | None = None
        """The loss of the first step this process trained (the divergence check's origin)."""

    def start(self, parts: RunParts) -> None:
        """After resume: merge the history and the configured ranges into the record and give
        the data stream every skipped range."""
        record = self.record
        record.merge_history(parts.run_dir)
        for start, end in parse_sequence_ranges(self.config.skip_sequences,
                                                field_name="faults.skip_sequences"):
            record.add_skip(start, end)
        parts.data.train.set_skip_ranges(record.skip_ranges)

    def replay_due(self, step: int) -> bool:
        """True when step ``step`` (1-based) is to be computed twice and compared."""
        interval = self.config.sdc_replay_interval
        return interval > 0 and step % interval == 0

    def note_replay(self, mismatch: str | None) -> None:
        """The replay of the step just taken: its mismatch message, or None when it agreed;
        the next `after_step` handles it as a replica mismatch."""
        self._replay_mismatch = mismatch

    def after_step(self, parts: RunParts, progress: Progress, report: StepReport) -> Decision:
        """Check the step just taken and decide. Collective (every rank decides the same: the
        loss is averaged over ranks, skips agree by construction)."""
        decision = self._replicas_disagree(parts, progress)
        if decision is not None:
            return decision
        if report.skipped:
            return self._after_skip(parts, progress)
        self.consecutive_skips = 0
        if self.detector is None and not self._divergence_watched(report.step):
            return CONTINUE
        loss = mean_over_ranks(report.loss)
        if self._divergence_watched(report.step):
            decision = self._diverged(parts, progress, loss)
            if decision is not None:
                return decision
        if self.detector is None:
            return CONTINUE
        spike = self.detector.observe(report.step, loss)
        if spike is None:
            return CONTINUE
        reason = (f"loss spike at step {spike.step}: {spike.loss:.4f} against a median of "
                  f"{spike.median:.4f} ({spike.sigmas:.1f} robust deviations, threshold "
                  f"{self.config.spike_threshold})")
        if self.config.spike_action == "stop":
            return stop(RunFaultError(f"{reason}; faults.spike_action='stop' ends the run"))
        return self._roll_back(parts, spike_step=spike.step,
                               at_most=spike.step - self.config.rollback_min_steps,
                               reason=reason, spike=spike)

    def _divergence_watched(self, step: int) -> bool:
        return self.config.divergence_margin > 0 and step <= self.config.spike_warmup_steps

    def _diverged(self, parts: RunParts, progress: Progress, loss: float) -> Decision | None:
        """Before the detector arms: a loss more than ``divergence_margin`` above the initial
        one (or non-finite) is handled as a spike; None when it is not one."""
        cfg, step = self.config, progress.step
        if self.initial_loss is None and math.isfinite(loss):
            self.initial_loss = loss
            return None
        initial = self.initial_loss
        if math.isfinite(loss) and (initial is None or loss - initial <= cfg.divergence_margin):
            return None
        above = (f"{loss - initial:.2f} nats above the initial loss {initial:.4f}"
                 if initial is not None and math.isfinite(loss) else
                 f"the initial loss was {initial:.4f}" if initial is not None else
                 "no finite loss yet")
        reason = (f"training diverged at step {step}: loss {loss:.4f}, {above} "
                  f"(faults.divergence_margin={cfg.divergence_margin:g}, checked until "
                  f"faults.spike_warmup_steps={cfg.spike_warmup_steps})")
        advice = "lower optim.lr or lengthen schedule.warmup_steps"
        if cfg.spike_action == "stop":
            return stop(RunFaultError(
                f"{reason}; faults.spike_action='stop' ends the run: {advice}"))
        at_most = step - cfg.rollback_min_steps
        missing = (f"no complete checkpoint of step <= {at_most} in {parts.checkpoint_dir} "
                   "to roll back to" if at_most > 0 else "too early for a checkpoint "
                   f"faults.rollback_min_steps={cfg.rollback_min_steps} steps before it")
        return self._roll_back(parts, spike_step=step, at_most=at_most,
                               reason=f"{reason}; {advice}", spike=None,
                               missing=f"{reason}; {missing}, so the run stops: {advice}")

    def _replicas_disagree(self, parts: RunParts, progress: Progress) -> Decision | None:
        message, self._replay_mismatch = self._replay_mismatch, None
        good_until = progress.step - 1  # a replay mismatch: the state before this step
        interval = self.config.sdc_check_interval
        if message is None and self.replica_check is not None and interval > 0 and (
                progress.step % interval == 0):
            message = self.replica_check.mismatch(parts.model.module, parts.optimizer.state)
            good_until = self.last_good_check
            if message is None:
                self.last_good_check = progress.step
        if message is None:
            return None
        reason = f"step {progress.step}: {message}"
        append_history(parts.run_dir, {"event": "sdc", "step": progress.step, "reason": reason})
        if self.config.sdc_action == "stop":
            return stop(SilentDataCorruptionError(
                f"{reason}; faults.sdc_action='stop' ends the run: restart it without the "
                f"suspect ranks' hosts, from a checkpoint of step <= {good_until}"
            ))
        return self._roll_back(parts, spike_step=progress.step, at_most=good_until,
                               reason=reason, spike=None)

    def _after_skip(self, parts: RunParts, progress: Progress) -> Decision:
        record, cfg = self.record, self.config
        record.skipped_steps += 1
        self.consecutive_skips += 1
        if record.skipped_steps > cfg.max_skipped_steps:
            return stop(RunFaultError(
                f"step {progress.step}: {record.skipped_steps} steps of the run had a non-finite "
                f"loss or gradient norm, more than faults.max_skipped_steps="
                f"{cfg.max_skipped_steps}; the run stops. Lower optim.lr or set optim.grad_clip"
            ))
        if self.consecutive_skips <= cfg.max_consecutive_skips:
            return CONTINUE
        reason = (f"{self.consecutive_skips} non-finite steps in a row up to step "
                  f"{progress.step} (faults.max_consecutive_skips={cfg.max_consecutive_skips})")
        if cfg.nan_cap_action == "stop":
            return stop(RunFaultError(f"{reason}; faults.nan_cap_action='stop' ends the run. "
                                      "Lower optim.lr or set optim.grad_clip"))
        first = progress.step - self.consecutive_skips + 1
        self.consecutive_skips = 0  # the rolled-back run counts afresh
        return self._roll_back(parts, spike_step=first, at_most=first - cfg.rollback_min_steps,
                               reason=reason, spike=None)

    def _roll_back(self, parts: RunParts, *, spike_step: int, at_most: int, reason: str,
                   spike: Spike | None, missing: str | None = None) -> Decision:
        """A ROLL_BACK to step <= ``at_most`` for a fault at ``spike_step``, or STOP past the
        rollback cap. ``missing``: the message without such a checkpoint (the divergence
        check's, which takes precedence over the cap's: the cap is then `Decision.refused`)."""
        cfg = self.config
        recent = [r["spike_step"] for r in self.record.rollbacks
                  if r["spike_step"] > spike_step - cfg.rollback_window_steps]
        capped = ""
        if len(recent) >= cfg.max_rollbacks:
            capped = (
                f"{reason}; the run already rolled back {len(recent)} time(s) for spikes at "
                f"steps {recent} within faults.rollback_window_steps={cfg.rollback_window_steps}"
                f" (faults.max_rollbacks={cfg.max_rollbacks}), so it stops: lower optim.lr, "
                "raise schedule warmup or set optim.grad_clip"
            )
            if missing is None:
                return stop(RunFaultError(capped))
        if missing is None:
            missing = (f"{reason}; no complete checkpoint of step <= {at_most} in "
                       f"{parts.checkpoint_dir} to roll back to (faults.rollback_min_steps="
                       f"{cfg.rollback_min_steps}), so the run stops")
        return Decision(kind=Act.ROLL_BACK, reason=reason, spike_step=spike_step,
                        at_most=at_most, spike=spike, missing=missing, refused=capped)

    def rolled_back(self, parts: RunParts, decision: Decision,
                    target: tuple[int, Path | str] | None) -> None:
        """The loop acted on ROLL_BACK ``decision``: ``target`` is the ``(step, path)`` the
        checkpoint session restored (None: there was no checkpoint of step <= at_most; for a
        refused decision it was only looked up). Raises `RunFaultError` without a checkpoint
        or for a refused one; else skips the next ``rollback_skip_batches`` batches, records
        the rollback (record, ``faults.jsonl``), and forgets the undone steps' losses."""
        cfg, record = self.config, self.record
        if target is None:
            raise RunFaultError(decision.missing)
        if decision.refused:
            raise RunFaultError(decision.refused)
        to_step, path = target
        skip = skipped_range(parts, to_step, cfg.rollback_skip_batches)
        record.add_skip(*skip)
        record.add_rollback(decision.spike_step, to_step)
        parts.data.train.set_skip_ranges(record.skip_ranges)
        if self.detector is not None:
            self.detector.forget_after(to_step)
        event = {"event": "rollback", "reason": decision.reason,
                 "spike_step": decision.spike_step, "to_step": to_step, "checkpoint": str(path),
                 "skip": list(skip), "skip_batches": cfg.rollback_skip_batches}
        spike = decision.spike
        if spike is not None:
            event.update(loss=spike.loss, median=spike.median, deviation=spike.deviation)
        append_history(parts.run_dir, event)
        if parts.is_main:
            print(f"{decision.reason}: rolled back to {path} (step {to_step}) and skipping "
                  f"sequences [{skip[0]}, {skip[1]}) ({cfg.rollback_skip_batches} batches)",
                  file=sys.stderr)
