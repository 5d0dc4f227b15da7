"""The over-training page: implied inference volumes against the solver, the committed table
against its generator, the plot is written."""

from pathlib import Path

import pytest

from densetrain.scaling.inference import min_cost_for_loss
from densetrain.scaling.laws import CHINCHILLA_UNROUNDED
from densetrain.scaling.overtraining import (
    PUBLISHED_MODELS,
    implied_inference_tokens,
    markdown_table,
    plot_overtraining,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "overtraining.md"


@pytest.mark.parametrize("model", [m for m in PUBLISHED_MODELS if m.tokens is not None],
                         ids=lambda m: m.name)
def test_implied_volume_makes_the_model_the_least_flops_choice(model):
    law = CHINCHILLA_UNROUNDED
    implied = implied_inference_tokens(law, model.params, model.tokens)
    loss = float(law.loss(model.params, model.tokens))
    frontier = min_cost_for_loss(law, loss, 0.0)
    if implied is None:  # beyond the training-only frontier: more N than it wants
        assert model.params > frontier.num_params
        return
    best = min_cost_for_loss(law, loss, implied)
    assert best.num_params == pytest.approx(model.params, rel=1e-6)
    assert best.num_tokens == pytest.approx(model.tokens, rel=1e-6)


def test_committed_table_is_the_generated_one():
    text = DOC.read_text()
    start = text.index("<!-- overtraining-table:start -->\n") + len(
        "<!-- overtraining-table:start -->\n")
    end = text.index("<!-- overtraining-table:end -->")
    assert text[start:end].strip() == markdown_table().strip(), (
        "docs/overtraining.md is stale: run python -m densetrain.scaling.overtraining "
        "docs/overtraining.png and paste its table")


def test_every_placed_model_cites_its_source_and_undisclosed_ones_say_so():
    for model in PUBLISHED_MODELS:
        assert " et al. " in model.source or "model card" in model.source
        if model.tokens is None:
            assert "not disclosed" in model.source


def test_plot_is_a_png(tmp_path):
    path = plot_overtraining(tmp_path / "o.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
