"""`densetrain scaling optimal` and `densetrain plan --flops`: one allocation, one law, printed
with its constants; the inference budget; bad input."""

import json

import pytest

from densetrain.cli.main import main
from densetrain.scaling.inference import min_cost_for_loss, min_loss_for_budget
from densetrain.scaling.laws import CHINCHILLA_UNROUNDED
from densetrain.scaling.optimal import allocation, chinchilla_optimal

CONSTANTS = "E=1.6934, A=406.4, B=410.7, alpha=0.3392, beta=0.2849"


def test_plan_and_scaling_optimal_share_the_unrounded_law():
    # Hoffmann et al. 2022, Figure 4: ~40B at the Gopher budget 5.76e23 by approach 3.
    split = allocation(5.76e23)
    n_opt, d_opt, law = split.num_params, split.num_tokens, split.law
    closed = chinchilla_optimal(CHINCHILLA_UNROUNDED, 5.76e23)
    assert (n_opt, d_opt) == (closed.num_params, closed.num_tokens)
    assert 39e9 < n_opt < 41e9
    assert CONSTANTS in law


def test_plan_flops_prints_the_law_and_its_constants(capsys):
    assert main(["plan", "--flops", "1e22", "--devices", "64", "--global-batch", "256",
                 "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"Law: Chinchilla approach 3 (Hoffmann et al. 2022), unrounded fit: {CONSTANTS}" in out
    assert "Lifetime" not in out


def test_plan_with_inference_tokens_plans_the_over_trained_run(capsys):
    assert main(["plan", "--flops", "1e23", "--inference-tokens", "2e12", "--devices", "256",
                 "--global-batch", "512", "--top", "1"]) == 0
    out = capsys.readouterr().out
    expected = min_loss_for_budget(CHINCHILLA_UNROUNDED, 1e23, 2e12)
    assert f"N_opt {expected.num_params:.3e} params" in out
    assert f"D_opt {expected.num_tokens:.3e} tokens" in out
    assert "Sardana et al. 2024" in out and "Lifetime (2.000e+12 inference tokens)" in out


def test_plan_inference_tokens_without_flops_is_an_error(capsys):
    assert main(["plan", "--model", "llama3-8b", "--devices", "8",
                 "--inference-tokens", "1e12"]) == 2
    assert "--inference-tokens needs --flops" in capsys.readouterr().err


def test_scaling_optimal_prints_law_and_budget_split(capsys):
    assert main(["scaling", "optimal", "--flops", "1e23", "--inference-tokens", "1e12"]) == 0
    out = capsys.readouterr().out
    expected = min_loss_for_budget(CHINCHILLA_UNROUNDED, 1e23, 1e12)
    assert CONSTANTS in out
    assert f"N_opt  = {expected.num_params:.4g} parameters" in out
    assert f"inference FLOPs = {expected.inference_flops:.4g}" in out
    assert "training-only optimum at the same loss" in out


def test_scaling_optimal_target_loss(capsys):
    assert main(["scaling", "optimal", "--target-loss", "2.0", "--inference-tokens",
                 "2e12"]) == 0
    out = capsys.readouterr().out
    expected = min_cost_for_loss(CHINCHILLA_UNROUNDED, 2.0, 2e12)
    assert f"N_opt  = {expected.num_params:.4g} parameters" in out
    assert f"total FLOPs     = {expected.total_flops:.4g}" in out


@pytest.mark.parametrize("argv,message", [
    (["--target-loss", "1.5"], "target loss 1.5 must be above the law's irreducible loss E"),
    (["--flops", "1e22", "--inference-tokens", "-1"],
     "argument --inference-tokens: must be a finite number at least 0, got '-1'"),
    (["--flops", "1e22", "--inference-tokens", "nan"],
     "argument --inference-tokens: must be a finite number at least 0, got 'nan'"),
    (["--flops", "inf"], "argument --flops: must be a finite number above 0, got 'inf'"),
])
def test_scaling_optimal_bad_input(capsys, argv, message):
    try:  # the parser's refusals exit 2 as SystemExit, the command's return 2
        code = main(["scaling", "optimal", *argv])
    except SystemExit as refused:
        code = refused.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_scaling_optimal_fit_with_missing_constant(tmp_path, capsys):
    path = tmp_path / "fit.json"
    values = {k: {"value": v} for k, v in CHINCHILLA_UNROUNDED.as_dict().items() if k != "B"}
    path.write_text(json.dumps({"parametric": values}))
    assert main(["scaling", "optimal", "--flops", "1e22", "--fit", str(path)]) == 2
    assert "missing constant 'B'" in capsys.readouterr().err
