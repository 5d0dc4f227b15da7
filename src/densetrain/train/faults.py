"""Faults that do not crash a run but ruin it: non-finite steps past a cap and loss spikes.

`FaultGuard.after_step` runs in the loop after every step, before evaluation and callbacks (so a
spiking step is never checkpointed). On a loss spike (`SpikeDetector`) or too many non-finite
steps in a row, it rolls the run back in the same process, as PaLM §5.1 did: the newest complete
checkpoint at least ``faults.rollback_min_steps`` before the spike is loaded and the next
``faults.rollback_skip_batches`` batches of the deterministic data order are skipped. The
skipped ranges live in `FaultRecord` (an entry of the checkpointed state tree) and in
``<run_dir>/faults.jsonl``, so a later resume skips the same batches. Caps end the run with
`RunFaultError`. Before the spike detector arms (``faults.spike_warmup_steps``), a loss more
than ``faults.divergence_margin`` nats above the initial loss, or a non-finite one, is handled
as a spike: the early divergence of a learning rate far too high. `check_state_finite` refuses
to save a state tree holding NaN/inf anywhere (model, optimizer, anything with tensors).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

from densetrain.checkpoint import CheckpointSession
from densetrain.checkpoint.saving import check_state_finite, first_non_finite  # noqa: F401
from densetrain.config.sections import FaultsConfig, parse_sequence_ranges
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.mesh import ParallelMesh
from densetrain.train.evaluation import mean_over_ranks
from densetrain.train.fault_record import append_history
from densetrain.train.sdc import ReplicaCheck, replica_axis
from densetrain.train.spikes import Spike, SpikeDetector
from densetrain.train.state import Progress, RunParts, StepReport
from densetrain.train.step import NonFiniteLossError


class RunFaultError(NonFiniteLossError):
    """The run stopped on a numerical fault: non-finite steps or loss spikes past their caps,
    or corrupted replicas."""


class SilentDataCorruptionError(RunFaultError):
    """Data-parallel replicas disagree bit for bit (``faults.sdc_action="stop"``)."""


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
    """The loop's check after each step: non-finite caps and loss spikes → rollback or stop."""

    def __init__(self, config: FaultsConfig, *, replica_check: ReplicaCheck | None = None
                 ) -> None:
        self.config = config
        self.replica_check = replica_check
        self.settle_checkpoints: Callable[[], None] = lambda: None
        """Called before a rollback looks for its checkpoint: completes saves still written in
        the background (the trainer sets it to flush its callbacks)."""
        self.last_good_check = 0
        """Step of the newest replica check or replay that passed (0: the start)."""
        self.replay_mismatch: str | None = None
        """The message of the replay of the step just taken, if it disagreed."""
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
        record = parts.fault_record
        record.merge_history(parts.run_dir)
        for start, end in parse_sequence_ranges(self.config.skip_sequences,
                                                field_name="faults.skip_sequences"):
            record.add_skip(start, end)
        parts.data.train.set_skip_ranges(record.skip_ranges)

    def after_step(self, parts: RunParts, progress: Progress, report: StepReport) -> bool:
        """Check the step just taken; True when the run was rolled back (the step's report is
        then void). Raises `RunFaultError` when a cap is passed. Collective (every rank
        decides the same: the loss is averaged over ranks, skips agree by construction)."""
        if self._replicas_disagree(parts, progress):
            return True
        if report.skipped:
            return self._after_skip(parts, progress)
        self.consecutive_skips = 0
        if self.detector is None and not self._divergence_watched(report.step):
            return False
        loss = mean_over_ranks(report.loss)
        if self._divergence_watched(report.step) and self._diverged(parts, progress, loss):
            return True
        if self.detector is None:
            return False
        spike = self.detector.observe(report.step, loss)
        if spike is None:
            return False
        reason = (f"loss spike at step {spike.step}: {spike.loss:.4f} against a median of "
                  f"{spike.median:.4f} ({spike.sigmas:.1f} robust deviations, threshold "
                  f"{self.config.spike_threshold})")
        if self.config.spike_action == "stop":
            raise RunFaultError(f"{reason}; faults.spike_action='stop' ends the run")
        self.rollback(parts, progress, spike_step=spike.step,
                      at_most=spike.step - self.config.rollback_min_steps, reason=reason,
                      spike=spike)
        return True

    def _divergence_watched(self, step: int) -> bool:
        return self.config.divergence_margin > 0 and step <= self.config.spike_warmup_steps

    def _diverged(self, parts: RunParts, progress: Progress, loss: float) -> bool:
        """Before the detector arms: a loss more than ``divergence_margin`` above the initial
        one (or non-finite) is handled as a spike; True when the run was rolled back."""
        cfg, step = self.config, progress.step
        if self.initial_loss is None and math.isfinite(loss):
            self.initial_loss = loss
            return False
        initial = self.initial_loss
        if math.isfinite(loss) and (initial is None or loss - initial <= cfg.divergence_margin):
            return False
        above = (f"{loss - initial:.2f} nats above the initial loss {initial:.4f}"
                 if initial is not None and math.isfinite(loss) else
                 f"the initial loss was {initial:.4f}" if initial is not None else
                 "no finite loss yet")
        reason = (f"training diverged at step {step}: loss {loss:.4f}, {above} "
                  f"(faults.divergence_margin={cfg.divergence_margin:g}, checked until "
                  f"faults.spike_warmup_steps={cfg.spike_warmup_steps})")
        advice = "lower optim.lr or lengthen schedule.warmup_steps"
        if cfg.spike_action == "stop":
            raise RunFaultError(f"{reason}; faults.spike_action='stop' ends the run: {advice}")
        at_most = step - cfg.rollback_min_steps
        self.settle_checkpoints()
        if _session(parts).newest_at_most(at_most) is None:
            missing = (f"no complete checkpoint of step <= {at_most} in {parts.checkpoint_dir} "
                       "to roll back to" if at_most > 0 else "too early for a checkpoint "
                       f"faults.rollback_min_steps={cfg.rollback_min_steps} steps before it")
            raise RunFaultError(f"{reason}; {missing}, so the run stops: {advice}")
        self.rollback(parts, progress, spike_step=step, at_most=at_most,
                      reason=f"{reason}; {advice}", spike=None)
        return True

    def replay_due(self, step: int) -> bool:
        """True when step ``step`` (1-based) is to be computed twice and compared."""
        interval = self.config.sdc_replay_interval
        return interval > 0 and step % interval == 0

    def _replicas_disagree(self, parts: RunParts, progress: Progress) -> bool:
        message, self.replay_mismatch = self.replay_mismatch, None
        good_until = progress.step - 1  # a replay mismatch: the state before this step
        interval = self.config.sdc_check_interval
        if message is None and self.replica_check is not None and interval > 0 and (
                progress.step % interval == 0):
            message = self.replica_check.mismatch(parts.model.module, parts.optimizer.state)
            good_until = self.last_good_check
            if message is None:
                self.last_good_check = progress.step
        if message is None:
            return False
        reason = f"step {progress.step}: {message}"
        append_history(parts.run_dir, {"event": "sdc", "step": progress.step, "reason": reason})
        if self.config.sdc_action == "stop":
            raise SilentDataCorruptionError(
                f"{reason}; faults.sdc_action='stop' ends the run: restart it without the "
                f"suspect ranks' hosts, from a checkpoint of step <= {good_until}"
            )
        self.rollback(parts, progress, spike_step=progress.step, at_most=good_until,
                      reason=reason, spike=None)
        return True

    def _after_skip(self, parts: RunParts, progress: Progress) -> bool:
        record, cfg = parts.fault_record, self.config
        record.skipped_steps += 1
        self.consecutive_skips += 1
        if record.skipped_steps > cfg.max_skipped_steps:
            raise RunFaultError(
                f"step {progress.step}: {record.skipped_steps} steps of the run had a non-finite "
                f"loss or gradient norm, more than faults.max_skipped_steps="
                f"{cfg.max_skipped_steps}; the run stops. Lower optim.lr or set optim.grad_clip"
            )
        if self.consecutive_skips <= cfg.max_consecutive_skips:
            return False
        reason = (f"{self.consecutive_skips} non-finite steps in a row up to step "
                  f"{progress.step} (faults.max_consecutive_skips={cfg.max_consecutive_skips})")
        if cfg.nan_cap_action == "stop":
            raise RunFaultError(f"{reason}; faults.nan_cap_action='stop' ends the run. Lower "
                                "optim.lr or set optim.grad_clip")
        first = progress.step - self.consecutive_skips + 1
        self.rollback(parts, progress, spike_step=first, at_most=first - cfg.rollback_min_steps,
                      reason=reason, spike=None)
        self.consecutive_skips = 0
        return True

    def rollback(self, parts: RunParts, progress: Progress, *, spike_step: int, at_most: int,
                 reason: str, spike: Spike | None) -> None:
        """Load the newest checkpoint of step <= ``at_most`` (for a spike at ``spike_step``,
        ``rollback_min_steps`` before it), skip the next ``rollback_skip_batches`` batches,
        record it; `RunFaultError` past the rollback cap or without such a checkpoint."""
        cfg, record = self.config, parts.fault_record
        recent = [r["spike_step"] for r in record.rollbacks
                  if r["spike_step"] > spike_step - cfg.rollback_window_steps]
        if len(recent) >= cfg.max_rollbacks:
            raise RunFaultError(
                f"{reason}; the run already rolled back {len(recent)} time(s) for spikes at "
                f"steps {recent} within faults.rollback_window_steps={cfg.rollback_window_steps}"
                f" (faults.max_rollbacks={cfg.max_rollbacks}), so it stops: lower optim.lr, "
                "raise schedule warmup or set optim.grad_clip"
            )
        self.settle_checkpoints()  # an async save in flight becomes visible (or fails) first
        # find it, delete the later ones, load it (the record is kept), after-load hook
        target = _session(parts).rollback(at_most)
        if target is None:
            raise RunFaultError(
                f"{reason}; no complete checkpoint of step <= {at_most} in "
                f"{parts.checkpoint_dir} to roll back to (faults.rollback_min_steps="
                f"{cfg.rollback_min_steps}), so the run stops"
            )
        to_step, path = target
        skip = skipped_range(parts, to_step, cfg.rollback_skip_batches)
        record.add_skip(*skip)
        record.add_rollback(spike_step, to_step)
        parts.data.train.set_skip_ranges(record.skip_ranges)
        if self.detector is not None:
            self.detector.forget_after(to_step)
        event = {"event": "rollback", "reason": reason, "spike_step": spike_step,
                 "to_step": to_step, "checkpoint": str(path), "skip": list(skip),
                 "skip_batches": cfg.rollback_skip_batches}
        if spike is not None:
            event.update(loss=spike.loss, median=spike.median, deviation=spike.deviation)
        append_history(parts.run_dir, event)
        if parts.is_main:
            print(f"{reason}: rolled back to {path} (step {to_step}) and skipping sequences "
                  f"[{skip[0]}, {skip[1]}) ({cfg.rollback_skip_batches} batches)",
                  file=sys.stderr)


def _session(parts: RunParts) -> CheckpointSession:
    """The run's checkpoint session (built by `train` with the parts)."""
    if parts.checkpoints is None:
        raise RuntimeError("a rollback needs the run's checkpoint session (parts.checkpoints)")
    return parts.checkpoints
