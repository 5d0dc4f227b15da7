"""PNG plots of scaling fits (matplotlib, Agg backend; each file written to a temporary name and
renamed): IsoFLOP profiles with their minima, the compute-optimal frontier, fit residuals."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from densetrain.scaling.fit_isoflop import FrontierFit
from densetrain.scaling.fit_parametric import ParametricFit, log_residuals
from densetrain.scaling.optimal import chinchilla_optimal_laws
from densetrain.scaling.results import ResultsTable


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        _pyplot().close(fig)
    return path


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG to ``path`` through a temporary name, then close it."""
    return _save(fig, Path(path))


def plot_isoflop(fit: FrontierFit, path: str | os.PathLike, *, param_label: str = "N",
                 table: ResultsTable | None = None) -> Path:
    """Loss against N for each budget: runs, fitted parabola and its minimum; with ``table``,
    the runs of budgets without a minimum too (hollow markers, no parabola)."""
    from densetrain.scaling.fit_isoflop import budgets_of

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if table is not None and fit.without_minimum:
        budgets = budgets_of(table)
        for budget in fit.without_minimum:
            members = np.flatnonzero(budgets == budget)
            order = members[np.argsort(table.params[members])]
            ax.plot(table.params[order], table.loss[order], ls=":", color="grey", marker="o",
                    mfc="none", label=f"C = {budget:.2g} (no minimum)")
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(fit.profiles)))
    for profile, color in zip(fit.profiles, colors, strict=True):
        if table is not None:  # runs outside the fitted window: hollow markers
            members = np.flatnonzero(budgets_of(table) == profile.budget)
            ax.scatter(table.params[members], table.loss[members], s=22, facecolors="none",
                       edgecolors=color)
        ax.scatter(profile.params, profile.loss, color=color, s=22,
                   label=f"C = {profile.budget:.2g}")
        grid = np.geomspace(profile.params.min() / 1.3, profile.params.max() * 1.3, 100)
        ax.plot(grid, profile.predict(grid), color=color, lw=1)
        marker = "*" if profile.minimum_inside else "X"
        ax.scatter([profile.n_opt], [profile.loss_opt], color=color, marker=marker, s=140,
                   edgecolor="black", zorder=5)
    ax.set_xscale("log")
    ax.set_xlabel(f"parameters {param_label}")
    ax.set_ylabel("final loss")
    ax.set_title("IsoFLOP profiles (star: minimum of each parabola)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, Path(path))


def plot_frontier(
    fits: list[FrontierFit], parametric: ParametricFit | None, path: str | os.PathLike,
    *, param_label: str = "N",
) -> Path:
    """N_opt against C: each approach's optima and power law, and approach 3's closed form."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    all_flops = np.concatenate([f.flops for f in fits]) if fits else np.array([1e12, 1e13])
    grid = np.geomspace(all_flops.min() / 2, all_flops.max() * 2, 100)
    for fit, color in zip(fits, ("tab:blue", "tab:orange"), strict=False):
        a = fit.estimates["a"]
        ax.scatter(fit.flops, fit.n_opt, color=color, s=24)
        ax.plot(grid, fit.n_law(grid), color=color, label=f"{fit.approach}: a = {a}")
    if parametric is not None:
        n_law, _ = chinchilla_optimal_laws(parametric.law)
        ax.plot(grid, n_law(grid), color="tab:green", ls="--",
                label=f"parametric: a = {parametric.estimates['a']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs C = 6·N·D")
    ax.set_ylabel(f"compute-optimal {param_label}")
    ax.set_title("Compute-optimal frontier N_opt(C)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, Path(path))


def plot_residuals(table: ResultsTable, parametric: ParametricFit,
                   path: str | os.PathLike) -> Path:
    """Approach 3 residuals (log predicted - log observed loss) against N, coloured by C."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    residuals = log_residuals(parametric.law, table)
    points = ax.scatter(table.params, residuals, c=np.log10(table.flops), cmap="viridis", s=24)
    fig.colorbar(points, ax=ax, label="log10 C")
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("log L_fit - log L")
    ax.set_title(f"Parametric fit residuals (rms {np.sqrt(np.mean(residuals**2)):.3g})")
    ax.grid(alpha=0.3, which="both")
    return _save(fig, Path(path))
