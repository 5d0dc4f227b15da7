"""Configuration of optimisation: the ``[optim]`` and ``[schedule]`` sections of a job config.

Only simple field types (str, int, float, bool, lists of those, Optional) so that the job config
system can compose them from TOML and ``--optim.field=value`` overrides.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from densetrain.errors import UserError

OPTIMIZERS = ("adamw", "adafactor", "sgd")
SCHEDULES = ("cosine", "wsd", "constant", "linear", "rsqrt")
WSD_DECAY_SHAPES = ("linear", "1-sqrt", "cosine")


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer and its hyperparameters.

    Attributes:
        name: ``adamw`` (torch's AdamW, decoupled weight decay), ``adafactor`` (PaLM §5 style:
            unfactored second moment, parameter scaling, β2 = 1 − k^−0.8, update clipping) or
            ``sgd`` (with momentum ``betas[0]``).
        lr: peak learning rate; the schedule multiplies it.
        betas: (β1, β2). β2 = 0.95 as GPT-3 (Brown et al. 2020, App. B) and LLaMA use. For
            Adafactor β1 is the momentum (PaLM: 0.9; 0 = no first moment) and β2 is unused
            (its decay follows ``adafactor_beta2_decay``). For SGD β1 is the momentum.
        eps: AdamW epsilon (Adafactor uses ``adafactor_eps1``).
        weight_decay: decoupled weight decay coefficient (0.1 in GPT-3 and LLaMA).
        decay_embeddings: also decay token/position embeddings (and a tied output matrix).
            Norm weights and biases are never decayed.
        grad_clip: global gradient-norm clipping threshold; 0 turns clipping off.
        fused: use torch's fused AdamW kernel; None = fused where the device supports it,
            foreach otherwise.
        adafactor_beta2_decay: exponent c in β2_k = 1 − k^−c (PaLM: 0.8).
        adafactor_clip_threshold: update clipping d: the update is divided by max(1, RMS(u)/d)
            (Shazeer & Stern 2018, §6; 1.0).
        adafactor_eps1: ε1, added to the squared gradients (Shazeer & Stern 2018: 1e-30).
        adafactor_eps2: ε2, floor of the parameter RMS used by parameter scaling (1e-3).
        adafactor_param_scaling: multiply the step by max(ε2, RMS(parameter)) (PaLM: on).
        adafactor_factored: factor the second moment of matrices into row and column
            statistics (Shazeer & Stern 2018); PaLM trained "without factorization".
        weight_decay_lr_power: Adafactor only: the decay applied each step is
            ``weight_decay * lr_t ** power * param``. 1 is AdamW-style decoupled decay; PaLM's
            "dynamic weight decay of lr^2.0" is ``weight_decay = 1.0, power = 2``.
    """

    name: str = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    grad_clip: float = 1.0
    fused: bool | None = None
    adafactor_beta2_decay: float = 0.8
    adafactor_clip_threshold: float = 1.0
    adafactor_eps1: float = 1e-30
    adafactor_eps2: float = 1e-3
    adafactor_param_scaling: bool = True
    adafactor_factored: bool = False
    weight_decay_lr_power: float = 1.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``optim.<field>``, the bad value and what is allowed."""
        _choice("optim.name", self.name, OPTIMIZERS)
        _positive("optim.lr", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(
                f"optim.betas must be two numbers in [0, 1) (β1, β2), got {list(self.betas)}"
            )
        _positive("optim.eps", self.eps)
        _non_negative("optim.weight_decay", self.weight_decay)
        _non_negative("optim.grad_clip", self.grad_clip)
        _positive("optim.adafactor_beta2_decay", self.adafactor_beta2_decay)
        _non_negative("optim.adafactor_clip_threshold", self.adafactor_clip_threshold)
        _positive("optim.adafactor_eps1", self.adafactor_eps1)
        _positive("optim.adafactor_eps2", self.adafactor_eps2)
        _non_negative("optim.weight_decay_lr_power", self.weight_decay_lr_power)
        if self.fused and self.name != "adamw":
            raise UserError(
                f"optim.fused=true is only available with optim.name='adamw', got {self.name!r}"
            )


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule and batch-size ramp.

    Attributes:
        name: ``cosine`` (linear warmup, then cosine decay to ``min_lr_ratio`` of the peak over
            the rest of the run, Chinchilla §3.1 and App. B), ``wsd`` (warmup-stable-decay, Hu et
            al. 2024 MiniCPM §4), ``constant`` (after warmup), ``linear`` (linear decay to
            ``min_lr_ratio``) or ``rsqrt`` (constant to ``warmup_steps`` then ∝ 1/√step,
            PaLM §5 / T5).
        warmup_steps: steps of linear warmup.
        warmup_tokens: warmup given in tokens (GPT-3: 375M); when > 0, ``warmup_steps`` is
            derived from it through the batch-size schedule.
        min_lr_ratio: final learning rate as a share of the peak (Chinchilla: 0.1).
        decay_fraction: ``wsd``: share of the run spent in the final decay.
        decay_shape: ``wsd``: ``linear``, ``1-sqrt`` (Hägele et al. 2024) or ``cosine``.
        batch_ramp_start: first global batch in sequences of the GPT-3 batch-size ramp
            (Brown et al. 2020, App. B); 0 = no ramp.
        batch_ramp_tokens: tokens over which the batch grows linearly to the full batch.
        batch_ramp_increment: batch growth step in sequences; must keep the batch divisible by
            micro_batch_size × data-parallel size. 0 = micro_batch_size × data-parallel size.
    """

    name: str = "cosine"
    warmup_steps: int = 0
    warmup_tokens: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    decay_shape: str = "linear"
    batch_ramp_start: int = 0
    batch_ramp_tokens: int = 0
    batch_ramp_increment: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``schedule.<field>``, the bad value and what is allowed."""
        _choice("schedule.name", self.name, SCHEDULES)
        _choice("schedule.decay_shape", self.decay_shape, WSD_DECAY_SHAPES)
        for name in ("warmup_steps", "warmup_tokens", "batch_ramp_start", "batch_ramp_tokens",
                     "batch_ramp_increment"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"schedule.{name} must be an integer >= 0, got {value!r}")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise UserError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0.0 < self.decay_fraction <= 1.0):
            raise UserError(
                f"schedule.decay_fraction must be in (0, 1], got {self.decay_fraction}"
            )
        if self.name == "rsqrt" and self.warmup_steps == 0 and self.warmup_tokens == 0:
            raise UserError(
                "schedule.name='rsqrt' needs schedule.warmup_steps > 0 (the step where the "
                "1/sqrt decay starts; PaLM: 10000)"
            )
        if self.batch_ramp_start > 0 and self.batch_ramp_tokens <= 0:
            raise UserError(
                "schedule.batch_ramp_tokens must be > 0 when schedule.batch_ramp_start > 0 "
                f"(got {self.batch_ramp_tokens}); GPT-3 ramps over 4-12 billion tokens"
            )


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"{name} must be one of {list(allowed)}, got {value!r}{hint}")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UserError(f"{name} must be a finite number > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise UserError(f"{name} must be a finite number >= 0, got {value!r}")
