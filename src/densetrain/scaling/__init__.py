"""densetrain.scaling: Kaplan and Chinchilla scaling-law fits, compute-optimal allocation and
IsoFLOP sweeps (see docs/scaling.md)."""

from densetrain.scaling.analysis import ScalingAnalysis, analyse, format_report
from densetrain.scaling.fit_common import Estimate, FitError
from densetrain.scaling.fit_isoflop import LossCurve, fit_envelope, fit_isoflop
from densetrain.scaling.fit_kaplan import fit_kaplan_nd, fit_kaplan_single
from densetrain.scaling.fit_parametric import fit_parametric
from densetrain.scaling.laws import CHINCHILLA_PRINTED, CHINCHILLA_UNROUNDED, ChinchillaLaw
from densetrain.scaling.optimal import (
    Allocation,
    PowerLaw,
    chinchilla_optimal,
    kaplan_allocation_exponents,
    optimal_from_power_laws,
)
from densetrain.scaling.results import ResultsTable, load_results_csv

__all__ = [
    "CHINCHILLA_PRINTED",
    "CHINCHILLA_UNROUNDED",
    "Allocation",
    "ChinchillaLaw",
    "Estimate",
    "FitError",
    "LossCurve",
    "PowerLaw",
    "ResultsTable",
    "ScalingAnalysis",
    "analyse",
    "chinchilla_optimal",
    "fit_envelope",
    "fit_isoflop",
    "fit_kaplan_nd",
    "fit_kaplan_single",
    "fit_parametric",
    "format_report",
    "kaplan_allocation_exponents",
    "load_results_csv",
    "optimal_from_power_laws",
]
