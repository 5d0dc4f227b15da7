"""Compute-optimal allocation of a FLOP budget C between parameters N and tokens D (C = 6·N·D).

Two routes: the closed form of the parametric law (Hoffmann et al. 2022, eq. 4), and power laws
N_opt = k_N·C^a, D_opt = k_D·C^b fitted to measured optima (Chinchilla approaches 1 and 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from densetrain.errors import UserError
from densetrain.scaling.laws import ChinchillaLaw


@dataclass(frozen=True, kw_only=True)
class PowerLaw:
    """y = coefficient · x^exponent."""

    coefficient: float
    exponent: float

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        """Evaluate at ``x`` (array or scalar)."""
        return self.coefficient * np.asarray(x, dtype=float) ** self.exponent


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """A compute-optimal split of ``flops`` into ``num_params`` and ``num_tokens``."""

    flops: float
    num_params: float
    num_tokens: float

    @property
    def tokens_per_param(self) -> float:
        """D / N (about 20 for Chinchilla)."""
        return self.num_tokens / self.num_params


def _check_flops(flops: float) -> None:
    if not (isinstance(flops, int | float) and math.isfinite(flops) and flops > 0):
        raise UserError(f"flops must be a finite number > 0, got {flops!r}")


def chinchilla_optimal_laws(law: ChinchillaLaw) -> tuple[PowerLaw, PowerLaw]:
    """Closed form of the compute-optimal frontier of L = E + A/N^α + B/D^β under C = 6·N·D.

    Hoffmann et al. 2022, eq. 4: N_opt(C) = G·(C/6)^a, D_opt(C) = G^-1·(C/6)^b with
    G = (αA / (βB))^(1/(α+β)), a = β/(α+β), b = α/(α+β). Returned as power laws in C itself.
    """
    if law.alpha <= 0 or law.beta <= 0 or law.A <= 0 or law.B <= 0:
        raise UserError(
            "the closed form needs alpha, beta, A, B > 0, got "
            f"alpha={law.alpha}, beta={law.beta}, A={law.A}, B={law.B}"
        )
    total = law.alpha + law.beta
    exp_n = law.beta / total
    exp_d = law.alpha / total
    g = (law.alpha * law.A / (law.beta * law.B)) ** (1.0 / total)
    n_law = PowerLaw(coefficient=g * 6.0**-exp_n, exponent=exp_n)
    d_law = PowerLaw(coefficient=6.0**-exp_d / g, exponent=exp_d)
    return n_law, d_law


def chinchilla_optimal(law: ChinchillaLaw, flops: float) -> Allocation:
    """N_opt and D_opt for budget ``flops`` from the closed form (Chinchilla eq. 4)."""
    _check_flops(flops)
    n_law, d_law = chinchilla_optimal_laws(law)
    return Allocation(
        flops=float(flops), num_params=float(n_law(flops)), num_tokens=float(d_law(flops))
    )


def optimal_from_power_laws(n_law: PowerLaw, d_law: PowerLaw | None, flops: float) -> Allocation:
    """N_opt and D_opt from fitted power laws; without ``d_law``, D = C / (6·N_opt)."""
    _check_flops(flops)
    num_params = float(n_law(flops))
    num_tokens = float(d_law(flops)) if d_law is not None else flops / (6.0 * num_params)
    return Allocation(flops=float(flops), num_params=num_params, num_tokens=num_tokens)


def kaplan_allocation_exponents(
    alpha_n: float, alpha_b: float, alpha_s: float
) -> dict[str, float]:
    """Exponents of N, B, S, D in C_min from Kaplan et al. 2020 eqs. 1.7-1.8.

    N ∝ C^(α_C/α_N), B ∝ C^(α_C/α_B), S ∝ C^(α_C/α_S), D = B·S, where
    α_C = 1/(1/α_S + 1/α_B + 1/α_N). The N, B and S exponents sum to 1 (C = 6·N·B·S).
    """
    for name, value in (("alpha_n", alpha_n), ("alpha_b", alpha_b), ("alpha_s", alpha_s)):
        if not value > 0:
            raise UserError(f"{name} must be > 0, got {value}")
    alpha_c = 1.0 / (1.0 / alpha_s + 1.0 / alpha_b + 1.0 / alpha_n)
    exps = {"alpha_c": alpha_c, "N": alpha_c / alpha_n, "B": alpha_c / alpha_b}
    exps["S"] = alpha_c / alpha_s
    exps["D"] = exps["B"] + exps["S"]
    return exps


def params_exponent_from_data_exponent(data_exponent: float) -> float:
    """Under C = 6·N·D, N ∝ C^a and D ∝ C^b imply a = 1 - b (e.g. Kaplan Table 6: 1 - 0.27)."""
    return 1.0 - data_exponent


@dataclass(frozen=True, kw_only=True)
class NamedLaw:
    """A parametric law and where its constants come from (printed beside every answer)."""

    law: ChinchillaLaw
    source: str

    def describe(self) -> str:
        """``source: E=…, A=…, B=…, alpha=…, beta=…`` with the constants actually used."""
        constants = ", ".join(f"{k}={v:.6g}" for k, v in self.law.as_dict().items())
        return f"{self.source}: {constants}"


def published_law() -> NamedLaw:
    """Chinchilla's approach 3 law with the unrounded constants (``laws.CHINCHILLA_UNROUNDED``),
    the default of ``densetrain scaling optimal`` and ``densetrain plan --flops``."""
    from densetrain.scaling.laws import CHINCHILLA_UNROUNDED

    return NamedLaw(law=CHINCHILLA_UNROUNDED,
                    source="Chinchilla approach 3 (Hoffmann et al. 2022), unrounded fit")


@dataclass(frozen=True, kw_only=True)
class OptimalChoice:
    """The answer of ``compute_optimal``: (N, D) for a budget, its FLOPs split and the law."""

    flops: float
    """Total budget: training FLOPs, plus inference FLOPs when ``inference_tokens`` > 0."""
    num_params: float
    num_tokens: float
    inference_tokens: float
    training_flops: float
    inference_flops: float
    loss: float
    law: NamedLaw
    method: str

    @property
    def tokens_per_param(self) -> float:
        """D / N."""
        return self.num_tokens / self.num_params


def compute_optimal(flops: float, *, law: NamedLaw | None = None,
                    inference_tokens: float = 0.0) -> OptimalChoice:
    """The one compute-optimal allocation of ``densetrain scaling optimal`` and ``plan --flops``.

    Without inference tokens: Chinchilla's closed form (eq. 4) under C = 6·N·D. With them: the
    lowest loss at total budget C = 6·N·D + 2·N·T (``inference.min_loss_for_budget``).
    ``law`` defaults to ``published_law()``.
    """
    from densetrain.scaling.inference import check_law, check_non_negative, min_loss_for_budget

    named = law or published_law()
    check_law(named.law)
    tokens = check_non_negative("inference_tokens", inference_tokens)
    _check_flops(flops)
    if tokens == 0:
        alloc = chinchilla_optimal(named.law, flops)
        n, d = alloc.num_params, alloc.num_tokens
        method = "closed form, Hoffmann et al. 2022 eq. 4 (C = 6ND)"
        train, infer = 6.0 * n * d, 0.0
    else:
        found = min_loss_for_budget(named.law, flops, tokens)
        n, d = found.num_params, found.num_tokens
        train, infer = found.training_flops, found.inference_flops
        method = "inference-aware, Sardana et al. 2024 (C = 6ND + 2NT), brentq"
    return OptimalChoice(flops=float(flops), num_params=n, num_tokens=d,
                         inference_tokens=tokens, training_flops=train, inference_flops=infer,
                         loss=float(named.law.loss(n, d)), law=named, method=method)


def allocation(flops: float, *, inference_tokens: float = 0.0):
    """`compute_optimal` as the planner's ``Allocation`` (``densetrain plan --flops``): N_opt,
    D_opt and the law with its constants, Chinchilla's unrounded approach 3 by default."""
    from densetrain.planner.run_plan import Allocation

    choice = compute_optimal(flops, inference_tokens=inference_tokens)
    return Allocation(flops=float(flops), num_params=choice.num_params,
                      num_tokens=choice.num_tokens,
                      law=f"{choice.law.describe()}; {choice.method}",
                      inference_tokens=choice.inference_tokens)
