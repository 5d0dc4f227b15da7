"""Functional forms of the Kaplan and Chinchilla scaling laws, and their published constants.

Notation: N parameters, D training tokens, C training FLOPs (C = 6·N·D), L final loss (nats/token).

- Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (arXiv 2001.08361), eqs. 1.1-1.5:
  L(N) = (N_c/N)^α_N, L(D) = (D_c/D)^α_D, L(C) = (C_c/C)^α_C and
  L(N, D) = [(N_c/N)^(α_N/α_D) + D_c/D]^α_D, with N the non-embedding parameters.
- Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (Chinchilla,
  arXiv 2203.15556), eq. 2 / Appendix D.2: L(N, D) = E + A/N^α + B/D^β, with N all parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ArrayLike = np.ndarray | float


@dataclass(frozen=True, kw_only=True)
class ChinchillaLaw:
    """Parameters of the parametric loss L(N, D) = E + A/N^α + B/D^β (Chinchilla eq. 2)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, num_params: ArrayLike, num_tokens: ArrayLike) -> np.ndarray:
        """Predicted loss at N = ``num_params``, D = ``num_tokens`` (broadcasting arrays)."""
        return chinchilla_loss(num_params, num_tokens, self)

    def as_dict(self) -> dict[str, float]:
        """Plain dict of the five constants."""
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}


@dataclass(frozen=True, kw_only=True)
class KaplanNDLaw:
    """Parameters of Kaplan's L(N, D) = [(N_c/N)^(α_N/α_D) + D_c/D]^α_D (Kaplan eq. 1.5)."""

    n_c: float
    d_c: float
    alpha_n: float
    alpha_d: float

    def loss(self, num_params: ArrayLike, num_tokens: ArrayLike) -> np.ndarray:
        """Predicted loss at N = ``num_params``, D = ``num_tokens`` (broadcasting arrays)."""
        return kaplan_loss_nd(num_params, num_tokens, self)

    def as_dict(self) -> dict[str, float]:
        """Plain dict of the four constants."""
        return {"n_c": self.n_c, "d_c": self.d_c, "alpha_n": self.alpha_n, "alpha_d": self.alpha_d}


# Hoffmann et al. 2022, Appendix D.2 (eq. 10) as printed, and the unrounded fit behind Figure 4
# (log E = 0.5267228, log A = 6.0073404, log B = 6.0179186, α = 0.33917084, β = 0.2849083).
CHINCHILLA_PRINTED = ChinchillaLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
CHINCHILLA_UNROUNDED = ChinchillaLaw(E=1.6934, A=406.4, B=410.7, alpha=0.3392, beta=0.2849)

# Kaplan et al. 2020, Table 5 / eqs. 1.1-1.3 (N non-embedding parameters, D tokens, C in PF-days).
KAPLAN_ALPHA_N = 0.076
KAPLAN_N_C = 8.8e13
KAPLAN_ALPHA_D = 0.095
KAPLAN_D_C = 5.4e13
KAPLAN_ALPHA_C_MIN = 0.050
KAPLAN_C_C_MIN_PF_DAYS = 3.1e8
# Kaplan eq. 1.6 (learning curves L(N, S)) and the critical batch size B_crit = B_*/L^(1/α_B).
KAPLAN_ALPHA_S = 0.76
KAPLAN_ALPHA_B = 0.21
# Kaplan Table 2: the joint fit of eq. 1.5.
KAPLAN_ND = KaplanNDLaw(n_c=6.4e13, d_c=1.8e13, alpha_n=0.076, alpha_d=0.103)
# Kaplan Table 6 / Figure 14: empirical compute-efficient allocation with C_min in PF-days:
# N = 1.3e9·C^0.73, B = 2.0e6·C^0.24 tokens, S = 5.4e3·C^0.03 steps, D = 2e10·C^0.27 tokens.
KAPLAN_TABLE6_EXPONENTS = {"N": 0.73, "B": 0.24, "S": 0.03, "D": 0.27}
PF_DAY_FLOPS = 8.64e19
"""One petaflop/s-day in FLOPs (Kaplan §1.3)."""


def power_law(x: ArrayLike, scale: float, exponent: float) -> np.ndarray:
    """Kaplan's single-variable form L(x) = (scale / x)^exponent (eqs. 1.1-1.3)."""
    return (scale / np.asarray(x, dtype=float)) ** exponent


def chinchilla_loss(num_params: ArrayLike, num_tokens: ArrayLike, law: ChinchillaLaw) -> np.ndarray:
    """L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022, eq. 2)."""
    n = np.asarray(num_params, dtype=float)
    d = np.asarray(num_tokens, dtype=float)
    return law.E + law.A / n**law.alpha + law.B / d**law.beta


def kaplan_loss_nd(num_params: ArrayLike, num_tokens: ArrayLike, law: KaplanNDLaw) -> np.ndarray:
    """L(N, D) = [(N_c/N)^(α_N/α_D) + D_c/D]^α_D (Kaplan et al. 2020, eq. 1.5)."""
    n = np.asarray(num_params, dtype=float)
    d = np.asarray(num_tokens, dtype=float)
    return ((law.n_c / n) ** (law.alpha_n / law.alpha_d) + law.d_c / d) ** law.alpha_d


def training_flops(num_params: ArrayLike, num_tokens: ArrayLike) -> np.ndarray:
    """C ≈ 6·N·D (Kaplan §2.1; Chinchilla §3): forward 2 FLOPs per parameter per token,
    backward 4."""
    return 6.0 * np.asarray(num_params, dtype=float) * np.asarray(num_tokens, dtype=float)
