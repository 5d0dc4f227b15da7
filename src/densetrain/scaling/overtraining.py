"""Published models on the (N, D) plane against the Chinchilla frontier and the inference-aware
optimum (docs/overtraining.md). Regenerate the page's plot and table with::

    python -m densetrain.scaling.overtraining docs/overtraining.png

Sizes and token counts are as the papers disclose them; a model whose token count was not
disclosed is listed, not placed. The implied inference volume of a model is the T for which
its (N, D) is the least-FLOPs way to reach its own predicted loss (Sardana et al. 2024): the
stationarity condition of ``inference.min_cost_for_loss`` solved for T, k_i·T =
k_t·D·((α/β)·(A/N^α)/(B/D^β) - 1). A model trained short of Chinchilla's point has none.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densetrain.scaling.inference import min_cost_for_loss
from densetrain.scaling.laws import CHINCHILLA_UNROUNDED, ChinchillaLaw
from densetrain.scaling.optimal import chinchilla_optimal


@dataclass(frozen=True, kw_only=True)
class PublishedModel:
    """A model's disclosed parameter count and training tokens, with where they are stated."""

    name: str
    params: float
    tokens: float | None
    source: str


PUBLISHED_MODELS: tuple[PublishedModel, ...] = (
    PublishedModel(name="GPT-3 175B", params=175e9, tokens=300e9,
                   source="Brown et al. 2020, Table 2.1 and §2.2 (300B tokens)"),
    PublishedModel(name="Gopher 280B", params=280e9, tokens=300e9,
                   source="Rae et al. 2021, Table 1 and §3 (300B tokens)"),
    PublishedModel(name="Chinchilla 70B", params=70e9, tokens=1.4e12,
                   source="Hoffmann et al. 2022, §4.1 and Table 4 (1.4T tokens)"),
    PublishedModel(name="LLaMA 7B", params=6.7e9, tokens=1.0e12,
                   source="Touvron et al. 2023a, Table 2 (6.7B, 1.0T tokens)"),
    PublishedModel(name="LLaMA 65B", params=65.2e9, tokens=1.4e12,
                   source="Touvron et al. 2023a, Table 2 (65.2B, 1.4T tokens)"),
    PublishedModel(name="Llama 2 7B", params=7e9, tokens=2.0e12,
                   source="Touvron et al. 2023b, Table 1 (2.0T tokens)"),
    PublishedModel(name="Llama 2 70B", params=70e9, tokens=2.0e12,
                   source="Touvron et al. 2023b, Table 1 (2.0T tokens)"),
    PublishedModel(name="Llama 3 8B", params=8e9, tokens=15e12,
                   source="Meta 2024, Llama 3 model card (over 15T tokens)"),
    PublishedModel(name="Llama 3 70B", params=70e9, tokens=15e12,
                   source="Meta 2024, Llama 3 model card (over 15T tokens)"),
    PublishedModel(name="Llama 3 405B", params=405e9, tokens=15.6e12,
                   source="Dubey et al. 2024 (The Llama 3 Herd of Models), §1 (15.6T tokens)"),
    PublishedModel(name="Mistral 7B", params=7.3e9, tokens=None,
                   source="Jiang et al. 2023: 7.3B parameters; training tokens not disclosed"),
    PublishedModel(name="phi-1 1.3B", params=1.3e9, tokens=51e9,
                   source="Gunasekar et al. 2023, §2 and Figure 2.1 (51B tokens: about 8 passes "
                   "over 7B unique tokens)"),
    PublishedModel(name="Qwen3 0.6B", params=0.6e9, tokens=36e12,
                   source="Yang et al. 2025 (Qwen3 Technical Report), §3 (36T tokens)"),
    PublishedModel(name="Qwen3 32B", params=32.8e9, tokens=36e12,
                   source="Yang et al. 2025, §3 (36T tokens); "
                   "Qwen3-32B model card (32.8B)"),
)

INFERENCE_VOLUMES = (1e12, 1e13, 1e14, 1e15)
"""Lifetime inference tokens of the plotted inference-aware frontiers."""


def implied_inference_tokens(law: ChinchillaLaw, params: float, tokens: float) -> float | None:
    """The T for which (params, tokens) minimises training + inference FLOPs at its own loss,
    or None when the model is trained short of Chinchilla's point (no T >= 0 does)."""
    data_term = law.B / tokens**law.beta
    params_term = law.A / params**law.alpha
    excess = (law.alpha / law.beta) * params_term / data_term - 1.0
    return 3.0 * tokens * excess if excess >= 0 else None


def table_rows(law: ChinchillaLaw = CHINCHILLA_UNROUNDED) -> list[dict]:
    """One row per published model: N, D, D/N, the Chinchilla N for its 6ND, implied T."""
    rows = []
    for model in PUBLISHED_MODELS:
        row = {"model": model.name, "params": model.params, "tokens": model.tokens,
               "source": model.source}
        if model.tokens is not None:
            flops = 6.0 * model.params * model.tokens
            row["tokens_per_param"] = model.tokens / model.params
            row["chinchilla_params"] = chinchilla_optimal(law, flops).num_params
            row["implied_inference_tokens"] = implied_inference_tokens(
                law, model.params, model.tokens)
        rows.append(row)
    return rows


def markdown_table(law: ChinchillaLaw = CHINCHILLA_UNROUNDED) -> str:
    """The page's table (markdown)."""

    def fmt(value: float) -> str:
        for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
            if value >= scale:
                return f"{value / scale:.3g}{unit}"
        return f"{value:.3g}"

    lines = ["| model | N | D | D/N | Chinchilla N for the same 6ND | implied inference "
             "tokens T | source |", "|---|---|---|---|---|---|---|"]
    for row in table_rows(law):
        if row["tokens"] is None:
            lines.append(f"| {row['model']} | {fmt(row['params'])} | not disclosed | — | — | — "
                         f"| {row['source']} |")
            continue
        implied = row["implied_inference_tokens"]
        implied_text = "none (trained short of the frontier)" if implied is None else fmt(implied)
        lines.append(f"| {row['model']} | {fmt(row['params'])} | {fmt(row['tokens'])} | "
                     f"{row['tokens_per_param']:.0f} | {fmt(row['chinchilla_params'])} | "
                     f"{implied_text} | {row['source']} |")
    return "\n".join(lines)


_LABEL_OFFSETS = {"LLaMA 65B": (-58, -11), "GPT-3 175B": (-62, -11), "Llama 2 70B": (5, 4),
                  "Chinchilla 70B": (6, -3)}


def frontier_points(law: ChinchillaLaw, inference_tokens: float,
                    losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) of the least-FLOPs model for each target loss at ``inference_tokens``."""
    found = [min_cost_for_loss(law, float(loss), inference_tokens) for loss in losses]
    return (np.array([f.num_params for f in found]), np.array([f.num_tokens for f in found]))


def plot_overtraining(path: str | Path, law: ChinchillaLaw = CHINCHILLA_UNROUNDED) -> Path:
    """Write the (N, D) plane with the frontiers and the published models to ``path`` (PNG)."""
    from densetrain.scaling.plots import _pyplot, save_figure

    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(9, 6.5))
    losses = np.linspace(law.E + 0.06, 3.2, 120)
    n, d = frontier_points(law, 0.0, losses)
    ax.plot(n, d, color="black", lw=2.2, label="Chinchilla frontier (T = 0)")
    for volume, shade in zip(INFERENCE_VOLUMES, ("#9ecae1", "#6baed6", "#3182bd", "#08519c"),
                             strict=True):
        n, d = frontier_points(law, volume, losses)
        ax.plot(n, d, color=shade, lw=1.6, label=f"inference-aware, T = {volume:.0e} tokens")
    ratio_n = np.geomspace(3e8, 1e12, 50)
    ax.plot(ratio_n, 20 * ratio_n, color="grey", ls="--", lw=1,
            label="D = 20 N (Chinchilla approaches 1-2 rule of thumb)")
    for model in PUBLISHED_MODELS:
        if model.tokens is None:
            continue
        ax.scatter(model.params, model.tokens, color="#d62728", zorder=3, s=28)
        ax.annotate(model.name, (model.params, model.tokens), textcoords="offset points",
                    xytext=_LABEL_OFFSETS.get(model.name, (5, 3)), fontsize=8)
    ax.set(xscale="log", yscale="log", xlim=(3e8, 1e12), ylim=(1e10, 1e14),
           xlabel="parameters N", ylabel="training tokens D",
           title="Published models vs the compute-optimal frontiers\n(Chinchilla approach 3 "
           "law, unrounded; Mistral 7B not placed: tokens undisclosed)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, Path(path))


def main(argv: list[str] | None = None) -> int:
    """``python -m densetrain.scaling.overtraining OUT.png``: write the plot, print the table."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m densetrain.scaling.overtraining OUT.png", file=sys.stderr)
        return 2
    print(f"wrote {plot_overtraining(argv[0])}")
    print(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
