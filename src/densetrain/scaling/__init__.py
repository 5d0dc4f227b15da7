"""densetrain.scaling: Kaplan and Chinchilla scaling-law fits, compute-optimal allocation (with
and without an inference budget) and IsoFLOP sweeps (see docs/scaling.md).

The names below are loaded on first use (PEP 562), so that importing one light submodule
(``densetrain.scaling.optimal``, used by ``densetrain plan``) does not import SciPy's fitters.
"""

from __future__ import annotations

from densetrain.lazy import lazy_exports

_EXPORTS = {
    "ScalingAnalysis": "analysis",
    "analyse": "analysis",
    "format_report": "analysis",
    "Estimate": "fit_common",
    "FitError": "fit_common",
    "LossCurve": "fit_isoflop",
    "fit_envelope": "fit_isoflop",
    "fit_isoflop": "fit_isoflop",
    "fit_kaplan_nd": "fit_kaplan",
    "fit_kaplan_single": "fit_kaplan",
    "fit_parametric": "fit_parametric",
    "CHINCHILLA_PRINTED": "laws",
    "CHINCHILLA_UNROUNDED": "laws",
    "ChinchillaLaw": "laws",
    "Allocation": "optimal",
    "PowerLaw": "optimal",
    "chinchilla_optimal": "optimal",
    "kaplan_allocation_exponents": "optimal",
    "optimal_from_power_laws": "optimal",
    "compute_optimal": "optimal",
    "ResultsTable": "results",
    "load_results_csv": "results",
    "InferenceAwareAllocation": "inference",
    "min_cost_for_loss": "inference",
    "min_loss_for_budget": "inference",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
