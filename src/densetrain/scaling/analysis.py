"""Every fit of a results table at once, as a report and a JSON document (``scaling fit``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from densetrain.errors import UserError
from densetrain.scaling.fit_common import FitError
from densetrain.scaling.fit_isoflop import FrontierFit, LossCurve, fit_envelope, fit_isoflop
from densetrain.scaling.fit_kaplan import (
    KaplanNDFit,
    SingleLawFit,
    fit_kaplan_nd,
    fit_kaplan_single,
)
from densetrain.scaling.fit_parametric import ParametricFit, fit_parametric
from densetrain.scaling.optimal import chinchilla_optimal, optimal_from_power_laws
from densetrain.scaling.results import ResultsTable, load_loss_curve


@dataclass(kw_only=True)
class ScalingAnalysis:
    """The fits that succeeded and, by name, why the others could not be made."""

    kaplan: dict[str, SingleLawFit] = field(default_factory=dict)
    kaplan_nd: KaplanNDFit | None = None
    envelope: FrontierFit | None = None
    isoflop: FrontierFit | None = None
    parametric: ParametricFit | None = None
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def num_fitted(self) -> int:
        """How many of the seven fits succeeded."""
        others = (self.kaplan_nd, self.envelope, self.isoflop, self.parametric)
        return len(self.kaplan) + sum(f is not None for f in others)


def curves_from_table(table: ResultsTable) -> list[LossCurve]:
    """Loss curves of runs with a ``run_dir`` holding ``metrics.jsonl`` (else ``ValueError``).

    A relative ``run_dir`` is taken relative to the directory of the results file."""
    if not table.has_column("run_dir"):
        raise UserError(f"{table.source}: no 'run_dir' column, so no loss curves")
    base = Path(table.source).parent
    curves = []
    for i, row in enumerate(table.rows):
        points = load_loss_curve(base / row["run_dir"])
        curves.append(LossCurve(params=float(table.params[i]), tokens=points[:, 0],
                                loss=points[:, 1]))
    return curves


def analyse(table: ResultsTable, *, num_resamples: int = 100, seed: int = 0,
            max_starts: int | None = 64, isoflop_window: int | None = None) -> ScalingAnalysis:
    """Run the Kaplan fits and Chinchilla approaches 1-3; a fit that cannot be made or does not
    converge is recorded in ``failures`` with its reason, never reported as numbers."""
    out = ScalingAnalysis()
    for variable in ("N", "D", "C"):
        _attempt(out, f"kaplan_L({variable})", lambda v=variable: out.kaplan.__setitem__(
            v, fit_kaplan_single(v, table, num_resamples=num_resamples, seed=seed)))
    _attempt(out, "kaplan_L(N,D)", lambda: setattr(
        out, "kaplan_nd", fit_kaplan_nd(table, num_resamples=num_resamples, seed=seed)))
    _attempt(out, "approach1_envelope", lambda: setattr(out, "envelope", fit_envelope(
        curves_from_table(table), num_resamples=num_resamples, seed=seed)))
    _attempt(out, "approach2_isoflop", lambda: setattr(
        out, "isoflop", fit_isoflop(table, num_resamples=num_resamples, seed=seed,
                                    window=isoflop_window)))
    _attempt(out, "approach3_parametric", lambda: setattr(out, "parametric", fit_parametric(
        table, max_starts=max_starts, num_resamples=num_resamples, seed=seed)))
    return out


def _attempt(out: ScalingAnalysis, name: str, action) -> None:
    try:
        action()
    except (FitError, ValueError) as err:
        out.failures[name] = str(err)


def optimal_table(analysis: ScalingAnalysis, flops_values: list[float]) -> list[dict]:
    """N_opt and D_opt at each budget by every approach that succeeded."""
    rows = []
    for flops in flops_values:
        for name, fit in (("approach1", analysis.envelope), ("approach2", analysis.isoflop)):
            if fit is not None:
                alloc = optimal_from_power_laws(fit.n_law, fit.d_law, flops)
                rows.append({"approach": name, "flops": flops, "params": alloc.num_params,
                             "tokens": alloc.num_tokens})
        if analysis.parametric is not None:
            alloc = chinchilla_optimal(analysis.parametric.law, flops)
            rows.append({"approach": "approach3", "flops": flops, "params": alloc.num_params,
                         "tokens": alloc.num_tokens})
    return rows


def format_report(analysis: ScalingAnalysis, flops_values: list[float]) -> str:
    """Human-readable summary: estimates with 95% bootstrap intervals, then failures."""
    lines = ["Kaplan et al. 2020 power laws, L(x) = (x_c/x)^alpha:"]
    for variable, fit in analysis.kaplan.items():
        lines.append(f"  L({variable}): alpha = {fit.exponent}, {variable}_c = {fit.scale}  "
                     f"({len(fit.x)} points)")
    if analysis.kaplan_nd is not None:
        est = analysis.kaplan_nd.estimates
        lines.append("  L(N, D): " + ", ".join(f"{k} = {v}" for k, v in est.items()))
    lines.append("Chinchilla (Hoffmann et al. 2022), N_opt ∝ C^a, D_opt ∝ C^b:")
    for label, fit in (("approach 1 (envelope)", analysis.envelope),
                       ("approach 2 (IsoFLOP)", analysis.isoflop)):
        if fit is not None:
            lines.append(f"  {label}: a = {fit.estimates['a']}, b = {fit.estimates['b']}"
                         f"{_failed_note(fit.bootstrap_failures)}")
    if analysis.isoflop is not None:
        for p in analysis.isoflop.profiles:
            where = "inside" if p.minimum_inside else "OUTSIDE (extrapolated)"
            lines.append(f"    C = {p.budget:.3g}: N_opt = {p.n_opt:,.0f} ({where} the sampled "
                         f"range), loss at minimum {p.loss_opt:.4f}")
        for budget, reason in analysis.isoflop.without_minimum.items():
            lines.append(f"    C = {budget:.3g}: NO MINIMUM, left out ({reason})")
    if analysis.parametric is not None:
        est = analysis.parametric.estimates
        lines.append("  approach 3 (parametric): " + ", ".join(f"{k} = {v}" for k, v in
                                                             est.items())
                     + _failed_note(analysis.parametric.bootstrap_failures))
    rows = optimal_table(analysis, flops_values)
    if rows:
        lines.append("Compute-optimal allocation:")
        for row in rows:
            lines.append(f"  {row['approach']}: C = {row['flops']:.3g} -> N_opt = "
                         f"{row['params']:,.0f}, D_opt = {row['tokens']:,.0f}")
    for name, reason in analysis.failures.items():
        lines.append(f"NOT FITTED {name}: {reason}")
    return "\n".join(lines)


def _failed_note(failures: int) -> str:
    if not failures:
        return ""
    return (f"  ({failures} bootstrap resamples could not be fitted and are left out; "
            "no interval is given when they are the majority)")


def analysis_to_json(analysis: ScalingAnalysis) -> dict:
    """JSON-friendly form (estimates with intervals; failures with reasons)."""
    doc: dict = {"failures": analysis.failures}
    doc["kaplan"] = {v: {"alpha": f.exponent.as_dict(), "scale": f.scale.as_dict()}
                     for v, f in analysis.kaplan.items()}
    if analysis.kaplan_nd is not None:
        doc["kaplan_nd"] = {k: e.as_dict() for k, e in analysis.kaplan_nd.estimates.items()}
    for name in ("envelope", "isoflop"):
        fit = getattr(analysis, name)
        if fit is not None:
            doc[name] = {k: e.as_dict() for k, e in fit.estimates.items()}
            doc[name]["bootstrap_failures"] = fit.bootstrap_failures
    if analysis.isoflop is not None:
        doc["isoflop_minima"] = [{"budget": p.budget, "n_opt": p.n_opt, "loss_opt": p.loss_opt,
                                  "inside": p.minimum_inside} for p in analysis.isoflop.profiles]
        doc["isoflop_without_minimum"] = {str(b): r for b, r in
                                          analysis.isoflop.without_minimum.items()}
    if analysis.parametric is not None:
        doc["parametric"] = {k: e.as_dict() for k, e in analysis.parametric.estimates.items()}
        doc["parametric"]["bootstrap_failures"] = analysis.parametric.bootstrap_failures
    return doc


def load_parametric_law(path: str | Path):
    """The approach 3 law from a ``fit.json`` written by ``scaling fit``."""
    from densetrain.scaling.laws import ChinchillaLaw

    path = Path(path)
    if not path.is_file():
        raise UserError(f"fit file {path} does not exist; `densetrain scaling fit RESULTS` "
                        "writes one (fit.json)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise UserError(f"fit file {path} is not valid JSON: {error}") from None
    if not isinstance(doc, dict):
        raise UserError(f"fit file {path} must hold a JSON object (as `scaling fit` writes), "
                        f"got a {type(doc).__name__}")
    if "parametric" not in doc:
        reason = doc.get("failures", {}).get("approach3_parametric", "absent from the file")
        raise UserError(f"{path}: no parametric fit ({reason})")
    values = {k: doc["parametric"][k]["value"] for k in ("E", "A", "B", "alpha", "beta")}
    return ChinchillaLaw(**values)
