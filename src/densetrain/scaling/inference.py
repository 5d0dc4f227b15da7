"""Inference-aware allocation: the (N, D) that is cheapest over a model's lifetime.

Sardana et al. 2024, "Beyond Chinchilla-Optimal: Accounting for Inference in Language Model
Scaling Laws" (arXiv 2401.00448), §2: with L(N, D) = E + A/N^α + B/D^β (Chinchilla eq. 2) and
T expected inference tokens, lifetime compute is k_t·N·D for training plus k_i·N·T for
inference (k_t = 6, k_i = 2 by default: Kaplan §2.1's forward 2N and backward 4N per token).

Two problems, each reduced to one monotone equation in one variable and solved with SciPy's
bracketed ``brentq`` (the paper uses Newton's method; a bracket cannot diverge):

- ``min_cost_for_loss``: reach a target loss at the least total FLOPs. Writing the reducible
  loss ℓ - E as the sum s + g of the parameter term s = A/N^α and the data term g = B/D^β, the
  cost is stationary where k_t·D·((α/β)·s/g - 1) = k_i·T; the left side rises monotonically
  from 0 (at s/g = β/α, Chinchilla's optimum, where T = 0) to infinity, so the root is unique.
- ``min_loss_for_budget``: the lowest loss at a fixed total budget C = k_t·N·D + k_i·N·T.
  Along the budget line dL/dN = 0 where α·A/N^α = β·B/D^β · C / (C - k_i·N·T); the left side
  falls and the right side rises with N, so again the root is unique.

Errors name the value and its bound; a root that cannot be bracketed inside the physical range
(at least one parameter and one token) raises ``OptimumAtBracketEdgeError`` rather than
returning the edge as an answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from densetrain.errors import UserError
from densetrain.scaling.laws import ChinchillaLaw


class OptimumAtBracketEdgeError(UserError):
    """The optimum lies at (or beyond) an edge of the search bracket, so it is not an answer."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """FLOPs per parameter per token: training (forward + backward) and inference (forward)."""

    train_flops_per_param_token: float = 6.0
    inference_flops_per_param_token: float = 2.0

    def __post_init__(self) -> None:
        for name in ("train_flops_per_param_token", "inference_flops_per_param_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UserError(f"CostModel.{name} must be a finite number > 0, got {value!r}")

    @classmethod
    def from_config(cls, cfg, seq_len: int) -> CostModel:
        """Coefficients of one model shape from ``models.sizing``: PaLM's training FLOPs per
        token (6N + 12·L·H·Q·T, attention and the output layer included) over its total
        parameter count, and a third of that for inference (the forward pass). Both scale by
        the same factor, so the optimal (N, D) is that of 6/2; the FLOPs are the shape's."""
        from densetrain.models.sizing import flops_per_token_palm, param_counts

        per_param = flops_per_token_palm(cfg, seq_len) / param_counts(cfg).total
        return cls(train_flops_per_param_token=per_param,
                   inference_flops_per_param_token=per_param / 3.0)


@dataclass(frozen=True, kw_only=True)
class InferenceAwareAllocation:
    """An (N, D) with the loss the law predicts and its lifetime FLOPs."""

    num_params: float
    num_tokens: float
    inference_tokens: float
    loss: float
    training_flops: float
    inference_flops: float

    @property
    def total_flops(self) -> float:
        """Training plus inference FLOPs."""
        return self.training_flops + self.inference_flops

    @property
    def tokens_per_param(self) -> float:
        """Training tokens per parameter (D / N)."""
        return self.num_tokens / self.num_params


def check_law(law: ChinchillaLaw) -> None:
    """Raise ``ValueError`` naming any constant that is missing, non-finite or out of range
    (E >= 0; A, B, alpha, beta > 0)."""
    for name in ("E", "A", "B", "alpha", "beta"):
        value = getattr(law, name, None)
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise UserError(f"scaling law constant {name} must be a finite number, got {value!r}")
        if name == "E" and value < 0:
            raise UserError(f"scaling law constant E must be >= 0, got {value!r}")
        if name != "E" and value <= 0:
            raise UserError(f"scaling law constant {name} must be > 0, got {value!r}")


def check_non_negative(name: str, value: float) -> float:
    """``value`` as a float if it is finite and >= 0, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"{name} must be a finite number >= 0, got {value!r}")
    if value < 0:
        raise UserError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _allocation(law: ChinchillaLaw, n: float, d: float, t: float,
                cost: CostModel) -> InferenceAwareAllocation:
    if n < 1 or d < 1:
        raise OptimumAtBracketEdgeError(
            f"the optimum N = {n:.3g} parameters, D = {d:.3g} tokens lies below the edge of "
            "the search bracket (at least 1 parameter and 1 token): the law is used far "
            "outside its range"
        )
    return InferenceAwareAllocation(
        num_params=n, num_tokens=d, inference_tokens=t, loss=float(law.loss(n, d)),
        training_flops=cost.train_flops_per_param_token * n * d,
        inference_flops=cost.inference_flops_per_param_token * n * t,
    )


def min_cost_for_loss(law: ChinchillaLaw, target_loss: float, inference_tokens: float,
                      cost: CostModel | None = None) -> InferenceAwareAllocation:
    """The (N, D) reaching ``target_loss`` at the least training + inference FLOPs."""
    from scipy.optimize import brentq

    check_law(law)
    cost = cost or CostModel()
    t = check_non_negative("inference_tokens", inference_tokens)
    if not (isinstance(target_loss, int | float) and math.isfinite(target_loss)):
        raise UserError(f"target loss must be a finite number, got {target_loss!r}")
    if target_loss <= law.E:
        raise UserError(
            f"target loss {target_loss} must be above the law's irreducible loss E = {law.E}"
        )
    reducible = target_loss - law.E
    alpha, beta = law.alpha, law.beta
    w_chinchilla = alpha / (alpha + beta)  # share g/(ℓ-E) of the data term at T = 0

    def tokens(w: float) -> float:
        return (law.B / (reducible * w)) ** (1.0 / beta)

    def params(w: float) -> float:
        return (law.A / (reducible * (1.0 - w))) ** (1.0 / alpha)

    def gap(w: float) -> float:  # log of the stationarity condition; falls as w grows
        excess = (alpha / beta) * (1.0 - w) / w - 1.0
        if excess <= 0:
            return -math.inf
        log_tokens = math.log(law.B / (reducible * w)) / beta
        log_lhs = math.log(cost.train_flops_per_param_token) + log_tokens
        return log_lhs + math.log(excess) - math.log(cost.inference_flops_per_param_token * t)

    w = w_chinchilla
    if t > 0:
        hi = w_chinchilla * (1.0 - 1e-15)
        if gap(hi) < 0:  # otherwise T moves N by less than float precision: w stays put
            lo = w_chinchilla / 2.0
            while gap(lo) <= 0:
                lo /= 2.0
                if lo < 1e-300:
                    raise OptimumAtBracketEdgeError(
                        f"inference_tokens {t:.3g}: the optimum lies at the edge of the search "
                        "bracket (the data term's share of the loss gap below 1e-300)"
                    )
            w = brentq(gap, lo, hi, xtol=1e-300, rtol=1e-14, maxiter=500)
    return _allocation(law, params(w), tokens(w), t, cost)


def min_loss_for_budget(law: ChinchillaLaw, total_flops: float, inference_tokens: float,
                        cost: CostModel | None = None) -> InferenceAwareAllocation:
    """The (N, D) of lowest loss whose training + inference FLOPs equal ``total_flops``."""
    from scipy.optimize import brentq

    check_law(law)
    cost = cost or CostModel()
    t = check_non_negative("inference_tokens", inference_tokens)
    if not (isinstance(total_flops, int | float) and math.isfinite(total_flops)
            and total_flops > 0):
        raise UserError(f"flops must be a finite number > 0, got {total_flops!r}")
    c, k_t, k_i = float(total_flops), cost.train_flops_per_param_token, \
        cost.inference_flops_per_param_token

    def tokens(log_n: float) -> float:
        n = math.exp(log_n)
        return (c - k_i * n * t) / (k_t * n)

    def gap(log_n: float) -> float:  # log(αA/N^α) - log(βB/D^β · C/(C - k_i·N·T)); falls with N
        d = tokens(log_n)
        if d <= 0:
            return -math.inf
        rhs = math.log(law.beta * law.B) - law.beta * math.log(d) + math.log(c) \
            - math.log(c - k_i * math.exp(log_n) * t)
        return math.log(law.alpha * law.A) - law.alpha * log_n - rhs

    # N from 1 parameter up to where one training token is left.
    lo, hi = 0.0, math.log(c / (k_t + k_i * t))
    if hi <= lo:
        raise UserError(
            f"flops {c:.3g} cannot train even one parameter on one token with "
            f"{t:.3g} inference tokens (needs > {k_t + k_i * t:.3g})"
        )
    if gap(lo) <= 0 or gap(hi) >= 0:
        edge = "1 parameter" if gap(lo) <= 0 else "1 training token"
        raise OptimumAtBracketEdgeError(
            f"flops {c:.3g} with {t:.3g} inference tokens: the lowest loss lies at the edge of "
            f"the search bracket ({edge}), outside the law's range"
        )
    log_n = brentq(gap, lo, hi, xtol=1e-13, rtol=1e-14, maxiter=500)
    return _allocation(law, math.exp(log_n), tokens(log_n), t, cost)
