"""Learning-rate and batch-size schedules.

Step ``s`` counts optimizer updates already taken (0 for the first update); ``lr_at(s, ...)`` is
the multiplier of the peak learning rate used by update ``s``. With ``W`` warmup steps, ``T``
total steps and ``m = min_lr_ratio``:

- warmup (every schedule but rsqrt): ``(s + 1) / W`` for ``s < W`` (the last warmup step
  reaches the peak; no update is wasted at lr 0);
- decay progress ``p = clamp((s − W) / (T − W), 0, 1)``: it reaches 1 after the last update;
- ``cosine``: ``m + (1 − m) · ½ (1 + cos πp)``: one half cosine cycle equal to the run length
  after warmup, to 10% of the peak (Hoffmann et al. 2022, Chinchilla §3.1 and App. B: a cycle
  longer than the run overestimates the loss, and the LR decays 10×);
- ``linear``: ``1 − (1 − m) p``;
- ``constant``: 1;
- ``wsd`` (warmup-stable-decay, Hu et al. 2024, MiniCPM §4): 1 until ``T − D`` where
  ``D = round(decay_fraction · T)``, then with ``q = (s − (T − D)) / D``: ``linear``
  ``1 − (1 − m) q``, ``1-sqrt`` ``m + (1 − m)(1 − √q)`` (Hägele et al. 2024) or ``cosine``
  ``m + (1 − m) · ½ (1 + cos πq)``;
- ``rsqrt``: ``√(W / max(s, W))``: constant for the first W steps, then ∝ 1/√step (PaLM §5:
  1e-2 for 10k steps, then decayed at 1/√k).

The batch-size ramp follows GPT-3 (Brown et al. 2020, App. B): the global batch grows linearly
in tokens consumed from ``ramp_start`` sequences to the full batch over ``ramp_tokens`` tokens,
in steps of ``ramp_increment`` sequences (that keep it divisible by micro-batch × dp).
"""

from __future__ import annotations

import bisect
import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from densetrain.errors import UserError
from densetrain.optim.config import ScheduleConfig


def wsd_decay_steps(cfg: ScheduleConfig, total_steps: int) -> int:
    """Steps of the final decay of a WSD schedule: ``round(decay_fraction × total_steps)``, ≥ 1."""
    return max(1, int(round(cfg.decay_fraction * total_steps)))


def lr_at(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate for update ``step`` (see the module docstring)."""
    if cfg.warmup_tokens > 0:
        raise UserError(
            "schedule.warmup_tokens is unresolved; build the schedule from "
            "JobConfig.resolved(...) (it converts warmup_tokens into schedule.warmup_steps)"
        )
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    if cfg.name == "rsqrt":
        return math.sqrt(warmup / max(step, warmup))
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "wsd":
        decay_steps = wsd_decay_steps(cfg, total_steps)
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return 1.0
        return _decay(cfg.decay_shape, min(1.0, (step - decay_start) / decay_steps), floor)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if cfg.name == "cosine":
        return _decay("cosine", progress, floor)
    if cfg.name == "linear":
        return _decay("linear", progress, floor)
    raise UserError(f"schedule.name={cfg.name!r} is not a known schedule")


def _decay(shape: str, progress: float, floor: float) -> float:
    if shape == "linear":
        return 1.0 - (1.0 - floor) * progress
    if shape == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return floor + (1.0 - floor) * (1.0 - math.sqrt(progress))
    raise UserError(f"schedule.decay_shape={shape!r} is not one of linear, 1-sqrt, cosine")


class LRScheduler(LambdaLR):
    """``LambdaLR`` over ``lr_at`` whose state is just the step (Stateful for DCP).

    The optimizer's param-group ``lr`` is the peak; each group's lr is peak × ``lr_at(step)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int):
        cfg.validate()
        if total_steps < 1:
            raise UserError(f"total_steps must be >= 1, got {total_steps}")
        self.schedule_cfg = cfg
        self.total_steps = total_steps
        multiplier = functools.partial(lr_at, cfg=cfg, total_steps=total_steps)
        super().__init__(optimizer, lr_lambda=multiplier)

    def state_dict(self) -> dict:
        """``{"step": updates taken}``: the schedule itself is rebuilt from the job config."""
        return {"step": int(self.last_epoch)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Jump to ``state_dict["step"]`` and set every group's lr accordingly."""
        self.last_epoch = int(state_dict["step"])
        multiplier = lr_at(self.last_epoch, self.schedule_cfg, self.total_steps)
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base_lr * multiplier
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int
) -> LRScheduler:
    """The Stateful LR scheduler of ``cfg`` over a run of ``total_steps`` updates.

    Call ``scheduler.step()`` after each ``optimizer.step()``.
    """
    return LRScheduler(optimizer, cfg, total_steps)


class BatchSizeSchedule:
    """Global batch (in sequences) per step: constant, or GPT-3's linear ramp in tokens.

    Batch at consumed tokens c: ``min(full, start + ⌊c·K / R⌋ · inc)`` with ``K = (full −
    start) / inc`` increments over ``R = ramp_tokens`` tokens. Being a pure function of the step,
    it is precomputed as a short list of (first step, batch) levels.
    """

    def __init__(
        self,
        *,
        global_batch_size: int,
        seq_len: int,
        ramp_start: int = 0,
        ramp_tokens: int = 0,
        ramp_increment: int = 1,
    ):
        if ramp_start > 0 and (
            ramp_increment < 1 or (global_batch_size - ramp_start) % ramp_increment
            or ramp_start >= global_batch_size or ramp_tokens < 1
        ):
            raise UserError(
                f"batch ramp needs 0 < start ({ramp_start}) < full ({global_batch_size}), "
                f"(full - start) divisible by increment ({ramp_increment}), tokens "
                f"({ramp_tokens}) > 0"
            )
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.ramp_start = ramp_start
        self.ramp_tokens = ramp_tokens
        self.ramp_increment = ramp_increment
        self._first_steps, self._batches, self._tokens_at_level = self._levels()

    def _levels(self) -> tuple[list[int], list[int], list[int]]:
        full, start, inc = self.global_batch_size, self.ramp_start, self.ramp_increment
        if start <= 0:
            return [0], [full], [0]
        increments, ramp = (full - start) // inc, self.ramp_tokens
        first_steps, batches, tokens_at = [], [], []
        step = consumed = 0
        while True:
            level = min(increments, consumed * increments // ramp)
            batch = start + level * inc
            first_steps.append(step)
            batches.append(batch)
            tokens_at.append(consumed)
            if level == increments:
                return first_steps, batches, tokens_at
            next_threshold = -(-(level + 1) * ramp // increments)  # ceil((level+1)·R/K)
            tokens_per_step = batch * self.seq_len
            num_steps = -(-(next_threshold - consumed) // tokens_per_step)
            step += num_steps
            consumed += num_steps * tokens_per_step

    def batch_size_at(self, step: int) -> int:
        """Global batch in sequences for update ``step``."""
        return self._batches[bisect.bisect_right(self._first_steps, step) - 1]

    def tokens_before(self, step: int) -> int:
        """Tokens consumed by updates ``0 .. step − 1``."""
        level = bisect.bisect_right(self._first_steps, step) - 1
        steps_in_level = step - self._first_steps[level]
        return self._tokens_at_level[level] + steps_in_level * self._batches[level] * self.seq_len

    def steps_for_tokens(self, tokens: int) -> int:
        """Fewest updates that consume at least ``tokens`` tokens."""
        level = bisect.bisect_right(self._tokens_at_level, tokens) - 1
        remaining = tokens - self._tokens_at_level[level]
        tokens_per_step = self._batches[level] * self.seq_len
        return self._first_steps[level] + -(-remaining // tokens_per_step)

    def state_dict(self) -> dict:
        """The ramp's definition; a resume checks it is unchanged."""
        return {
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "ramp_start": self.ramp_start,
            "ramp_tokens": self.ramp_tokens,
            "ramp_increment": self.ramp_increment,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Raise ``ValueError`` when the saved ramp differs from this one (tokens would shift)."""
        current = self.state_dict()
        changed = {k: (state_dict.get(k), v) for k, v in current.items()
                   if state_dict.get(k) != v}
        if self.ramp_start > 0 and changed:
            raise UserError(
                f"the batch-size ramp differs from the checkpoint's ({changed}: saved, now); "
                "a ramp cannot change on resume"
            )


def batch_size_at(
    step: int,
    *,
    global_batch_size: int,
    seq_len: int,
    ramp_start: int = 0,
    ramp_tokens: int = 0,
    ramp_increment: int = 1,
) -> int:
    """Global batch of update ``step`` (a one-off ``BatchSizeSchedule(...).batch_size_at``)."""
    return BatchSizeSchedule(
        global_batch_size=global_batch_size, seq_len=seq_len, ramp_start=ramp_start,
        ramp_tokens=ramp_tokens, ramp_increment=ramp_increment,
    ).batch_size_at(step)
