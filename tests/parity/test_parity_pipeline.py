"""Parity ladder, pipeline layouts (each schedule, and pp composed with tp and fsdp).

Tolerance as in test_parity_dp_tp.py (2e-5 on losses and weights): microbatching changes only
the order of the gradient sums (mean of per-microbatch means over equal-sized microbatches).
"""

from __future__ import annotations

import ladder
import pytest
import torch
from test_parity_dp_tp import WEIGHT_TOL, assert_matches_control, control_for, weight_tol_for

from densetrain.testing import run_distributed

MULTI = ("interleaved_1f1b", "zero_bubble", "zbv")
PP2 = {
    f"pp2_{s}": dict(
        pp=2, dp_shard=1, pp_schedule=s, pp_microbatches=4,
        pp_virtual_stages=2 if s in MULTI else 1,
    )
    for s in ("gpipe", "1f1b", *MULTI)
}
PP4 = {
    f"pp4_{s}": dict(pp=4, dp_shard=1, pp_schedule=s, pp_microbatches=8)
    for s in ("gpipe", "1f1b")
}
# 4 ranks × 2 virtual stages need 8 layers: compared with an 8-layer control
PP4_MULTI = {
    f"pp4_{s}": dict(
        pp=4, dp_shard=1, pp_schedule=s, pp_microbatches=8, pp_virtual_stages=2,
        _model=dict(num_layers=8),
    )
    for s in MULTI
}
PP_COMPOSED_4 = {
    "pp2_tp2": dict(pp=2, tp=2, dp_shard=1, pp_microbatches=2),
    "pp2_fsdp2": dict(pp=2, dp_shard=2, pp_microbatches=2),
}
PP_COMPOSED_8 = {"pp2_tp2_dp2": dict(pp=2, tp=2, dp_shard=2, pp_microbatches=2)}
# FSDP stages reduce-scattering their gradients after every microbatch (parallel.pp_grad_reduce):
# the gradient is summed in the sharded fp32 accumulator instead of the unsharded one
PP_REDUCE_EVERY = {
    "pp2_fsdp2_microbatch": dict(pp=2, dp_shard=2, pp_microbatches=4,
                                 pp_grad_reduce="microbatch"),
    # and the stage kept gathered over the step (parallel.pp_reshard_after_forward = false),
    # as Llama 3 trained
    "pp2_fsdp2_microbatch_gathered": dict(pp=2, dp_shard=2, pp_microbatches=4,
                                          pp_grad_reduce="microbatch",
                                          pp_reshard_after_forward=False),
}


@pytest.fixture(scope="module")
def control():
    return ladder.run_control()


def _assert_all(results: dict, control: dict, *, weight_tol: float = WEIGHT_TOL) -> None:
    for name, result in results.items():
        try:
            assert_matches_control(result, control, weight_tol=weight_tol)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _run(layouts: dict, world: int) -> dict:
    names = list(layouts)
    per_rank = run_distributed(ladder.run_many_pipeline, world, [layouts[n] for n in names])
    return {n: per_rank[0][i] for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def pp2_results():
    return _run(PP2, 2)


@pytest.mark.parametrize("name", list(PP2))
def test_pp2_schedule_matches_control(name, pp2_results, control):
    assert_matches_control(pp2_results[name], control)


@pytest.mark.slow
def test_pp4_schedules_match_control(control):
    _assert_all(_run(PP4, 4), control)


@pytest.mark.slow
def test_pp4_multi_stage_schedules_match_control():
    # Weights within 1e-4 here (losses still 2e-5): 8 microbatches of one sequence each sum the
    # gradient in 8 parts, and AdamW's early updates are ~lr·g/|g|, so an entry whose gradient
    # is near zero moves by a visible amount for a 1e-9 change in g (seen: 1 of 8192 entries
    # of one matrix off by 3e-5). A wrong shard or missing microbatch moves whole tensors >1e-3.
    _assert_all(
        _run(PP4_MULTI, 4), ladder.run_control(model_overrides=dict(num_layers=8)),
        weight_tol=1e-4,
    )


@pytest.mark.slow
def test_pp_composed_on_four_ranks_matches_control(control):
    _assert_all(_run(PP_COMPOSED_4, 4), control)


def test_pp2_fsdp2_reducing_every_microbatch_matches_control(control):
    _assert_all(_run(PP_REDUCE_EVERY, 4), control)


@pytest.mark.slow
def test_pp2_tp2_dp2_on_eight_ranks_matches_control(control):
    _assert_all(_run(PP_COMPOSED_8, 8), control)


# Tied input/output embeddings: the last stage holds its own copy of the embedding matrix and
# the two copies' gradients are summed between the first and last pp rank; compared with the
# one-process tied model. "_clip" also checks the clipped norm counts the matrix once.
PP_TIED_2 = {
    "pp2_1f1b_tied": dict(pp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=4,
                          _model=dict(tie_embeddings=True), _clip=0.05),
    "pp2_interleaved_gpt2": dict(pp=2, dp_shard=1, pp_schedule="interleaved_1f1b",
                                 pp_virtual_stages=2, pp_microbatches=4, _arch="gpt2"),
}
PP_TIED_4 = {
    "pp2_tp2_gpt2": dict(pp=2, tp=2, dp_shard=1, pp_microbatches=2, _arch="gpt2"),
    # pp ranks 0 and 3: an embedding group that is not the pp group
    "pp4_1f1b_gpt2": dict(pp=4, dp_shard=1, pp_schedule="1f1b", pp_microbatches=8,
                          _arch="gpt2"),
}


def _tied_control(layout: dict) -> dict:
    return ladder.run_control(model_overrides=layout.get("_model"), clip=layout.get("_clip", 0.0),
                              architecture=layout.get("_arch", "llama"))


def _assert_tied(results: dict, layouts: dict, *, weight_tol: float = WEIGHT_TOL) -> None:
    for name, result in results.items():
        control = _tied_control(layouts[name])
        try:
            assert_matches_control(result, control, weight_tol=weight_tol)
            torch.testing.assert_close(torch.tensor(result["grad_norms"]),
                                       torch.tensor(control["grad_norms"]), atol=0, rtol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
        # every rank's full view of both stages' copies (tp ranks each gather one)
        first, *others = result["tied_copies"]
        assert others and all(torch.equal(first, o) for o in others), f"{name}: copies differ"


def test_pp2_tied_embeddings_match_control():
    _assert_tied(_run(PP_TIED_2, 2), PP_TIED_2)


@pytest.mark.slow
def test_pp_tied_embeddings_on_four_ranks_match_control():
    # Weights within 1e-4 (losses 2e-5), as for the multi-stage schedules above: the embedding
    # gradient is summed in another order (the two copies' parts, each over tp slices), and
    # AdamW's early updates magnify a 1e-9 change in a near-zero gradient entry (seen: 1 of 4096
    # entries of one matrix off by 3e-5 under pp2 x tp2); a missing sum moves whole tensors.
    _assert_tied(_run(PP_TIED_4, 4), PP_TIED_4, weight_tol=1e-4)


# The published families on pipelines: parallel blocks (NeoX, PaLM with tied embeddings and
# MQA, phi-1), BLOOM's embedding norm (first stage) with ALiBi, Qwen3's QK-norm; and the same
# stages tensor-parallel. Each compared with the one-process model of its architecture.
FAMILIES = ("neox", "palm", "phi", "bloom", "qwen3", "gopher")
PP_FAMILIES_2 = {
    f"pp2_1f1b_{arch}": dict(pp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=4,
                             _arch=arch)
    for arch in FAMILIES
}
PP_FAMILIES_4 = {
    f"pp2_tp2_{arch}": dict(pp=2, tp=2, dp_shard=1, pp_microbatches=2, _arch=arch)
    for arch in FAMILIES
} | {
    f"pp2_fsdp2_{arch}": dict(pp=2, dp_shard=2, pp_microbatches=2, _arch=arch)
    for arch in FAMILIES
}


def _assert_families(results: dict, layouts: dict, *, weight_tol: float | None = None) -> None:
    for name, result in results.items():
        try:
            assert_matches_control(result, control_for(layouts[name]),
                                   weight_tol=weight_tol or weight_tol_for(layouts[name]))
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_pp2_families_match_control():
    _assert_families(_run(PP_FAMILIES_2, 2), PP_FAMILIES_2)


@pytest.mark.slow
def test_pp2_tp2_families_match_control():
    # Weights within 2e-4 (losses 2e-5): Qwen3's layers.0.attn.wv.weight[23, 19] starts with a
    # gradient of 1.45e-8 (the matrix's median 2.9e-3), at Adam's eps, so a last-bit change of
    # it moves that one entry by up to 1.1e-4; a QK-norm gradient not summed over tp moves the
    # norm weights by 2e-2.
    _assert_families(_run(PP_FAMILIES_4, 4), PP_FAMILIES_4, weight_tol=2e-4)
