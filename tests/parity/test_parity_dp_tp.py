"""Parity ladder, data/tensor/context parallel layouts: each must match the one-process control.

Tolerance (fp32, 5 AdamW steps): per-step loss within 2e-5 absolute and final weights within
2e-5 absolute. Layouts change only the order of floating-point sums (gradient all-reduce over
ranks, TP partial sums split over the hidden dim), giving ~1e-6 differences per step in
practice; Adam's update divides by sqrt(v), which can amplify a 1e-7 relative gradient
difference on near-zero-variance entries, so the bound leaves 10-20x headroom while a real bug
(a missing 1/N, a wrong shard, a missed all-reduce) moves the loss by >1e-3 and weights by >1e-4.

The GPT-2-style model (``_arch="gpt2"``) has weights within 1e-4 (`GPT2_WEIGHT_TOL`): its key
biases get a gradient that is exactly zero in exact arithmetic (softmax is invariant to adding
q·b_k to every score), i.e. pure rounding noise that Adam turns into ~lr·g/eps steps (~1e-5),
and with this seed a few weight entries start with |g| ≈ 1e-8 ≈ Adam's eps, where a
last-bit change of the gradient moves the update by ~lr·δg/(4·eps). One process alone
moves by 2.9e-5 between its full-logit and chunked loss paths; the layouts here by ≤2.2e-5. A
real bug still shows far above it: positions whose SP gradient is not gathered over tp move
``pos_embeddings.weight`` by 1.4e-2 while the losses still agree to 5e-7.

The other architectures (NeoX, PaLM, phi, BLOOM, Qwen3) use the same 1e-4: their losses agree
to 1e-6, and one entry in a few thousand moves by up to 9e-5 between runs where its gradient is
near Adam's eps (QK-norm's 16-wide per-head norms and SwiGLU both amplify last-bit changes). A
QK-norm weight whose gradient is not summed over the tp ranks' heads moves by 2e-2.
"""

from __future__ import annotations

import ladder
import pytest
import torch

from densetrain.testing import run_distributed

LOSS_TOL = 2e-5
WEIGHT_TOL = 2e-5
GPT2_WEIGHT_TOL = 1e-4
ALIBI_WEIGHT_TOL = 1e-4
"""The ALiBi model moves one weight entry in 8192 by up to 3e-5 on tp2 alone (heads split, the
bias only sliced: a change of summation order), the same on cp2; losses stay within 2e-5. The
same Adam amplification of near-eps gradients as the GPT-2 model's (module docstring)."""

CLIP = 0.5
TWO_RANK = {
    "ddp2": dict(dp_replicate=2, dp_shard=1),
    "zero1_2": dict(dp_shard=2, zero_stage=1),
    "zero2_2": dict(dp_shard=2, zero_stage=2),
    "zero3_2": dict(dp_shard=2, zero_stage=3),
    "tp2": dict(tp=2, dp_shard=1, sequence_parallel=False),
    "tp2_sp": dict(tp=2, dp_shard=1, sequence_parallel=True),
    "fsdp2_ac_full": dict(dp_shard=2, activation_checkpointing="full"),
    "fsdp2_ac_selective": dict(dp_shard=2, activation_checkpointing="selective"),
    "ddp2_compute_loss": dict(dp_replicate=2, dp_shard=1, _compute_loss=True),
    "ddp2_ac_full_every2": dict(
        dp_replicate=2, dp_shard=1, activation_checkpointing="full", ac_every=2
    ),
    "cp2": dict(cp=2, dp_shard=1),
    # cp masks by global positions: ALiBi, document masks (documents straddle the chunks, and
    # positions restart per document), a window shorter than the sequence but not than a chunk
    "cp2_alibi": dict(cp=2, dp_shard=1, _model=dict(position_embedding="alibi")),
    "cp2_docs": dict(cp=2, dp_shard=1, _docs=True),
    "cp2_alibi_docs_compute_loss": dict(cp=2, dp_shard=1, _docs=True, _compute_loss=True,
                                        _model=dict(position_embedding="alibi")),
    "cp2_window": dict(cp=2, dp_shard=1, _model=dict(sliding_window=10)),
    # ALiBi with heads split over tp: each rank's bias has its own heads' slopes
    "tp2_alibi": dict(tp=2, dp_shard=1, sequence_parallel=False,
                      _model=dict(position_embedding="alibi")),
    "zero3_2_cpu_offload": dict(dp_shard=2, cpu_offload=True),
    # global-norm clipping at 0.5 (below the observed norms, so it scales): own clip for ZeRO-1/2
    "zero1_2_clip": dict(dp_shard=2, zero_stage=1, _clip=CLIP),
    "zero2_2_clip": dict(dp_shard=2, zero_stage=2, _clip=CLIP),
    "zero3_2_clip": dict(dp_shard=2, _clip=CLIP),
    # the trainer's loss path (Transformer.compute_loss, chunked head) on FSDP and on TP+SP
    "zero3_2_compute_loss": dict(dp_shard=2, _compute_loss=True),
    "tp2_sp_compute_loss": dict(tp=2, dp_shard=1, _compute_loss=True),
    # MQA: one kv head, replicated on both tp ranks (compared with an MQA control)
    "tp2_sp_mqa": dict(tp=2, dp_shard=1, _model=dict(num_kv_heads=1)),
    # GPT-2/GPT-3 architecture: tied embeddings (one vocab-parallel DTensor for embedding and
    # head), learned positions, LayerNorm and biases; compared with a GPT-2-style control
    "tp2_gpt2": dict(tp=2, dp_shard=1, sequence_parallel=False, _arch="gpt2"),
    "tp2_sp_gpt2": dict(tp=2, dp_shard=1, sequence_parallel=True, _arch="gpt2"),
    "tp2_sp_gpt2_compute_loss": dict(tp=2, dp_shard=1, _compute_loss=True, _arch="gpt2"),
    "tp2_sp_gpt2_clip": dict(tp=2, dp_shard=1, _clip=CLIP, _arch="gpt2"),
    # parallel attention + MLP blocks, one reduction of both branches: GPT-NeoX (two norms),
    # PaLM (one shared norm, MQA, tied), phi-1 (shared norm, biased head)
    "tp2_neox": dict(tp=2, dp_shard=1, sequence_parallel=False, _arch="neox"),
    "tp2_sp_neox": dict(tp=2, dp_shard=1, _arch="neox"),
    "tp2_palm": dict(tp=2, dp_shard=1, sequence_parallel=False, _arch="palm"),
    "tp2_sp_palm": dict(tp=2, dp_shard=1, _arch="palm"),
    "tp2_sp_palm_compute_loss": dict(tp=2, dp_shard=1, _compute_loss=True, _arch="palm"),
    "tp2_sp_phi": dict(tp=2, dp_shard=1, _arch="phi"),
    # QK-norm on each rank's heads (Qwen3), and BLOOM's embedding LayerNorm
    "tp2_qwen3": dict(tp=2, dp_shard=1, sequence_parallel=False, _arch="qwen3"),
    "tp2_sp_qwen3": dict(tp=2, dp_shard=1, _arch="qwen3"),
    # post-norm blocks (the original Transformer's and OPT-350m's order)
    "tp2_postnorm": dict(tp=2, dp_shard=1, sequence_parallel=False,
                         _model=dict(norm_position="post")),
    "tp2_sp_postnorm": dict(tp=2, dp_shard=1, _model=dict(norm_position="post")),
    # OPT-350m's shape: embedding projections (E = 32 -> D = 64 -> E), no final norm
    "tp2_projected": dict(tp=2, dp_shard=1, sequence_parallel=False,
                          _model=dict(embed_dim=32, final_norm=False)),
    "tp2_sp_projected": dict(tp=2, dp_shard=1, _model=dict(embed_dim=32, final_norm=False)),
    "tp2_sp_no_final_norm": dict(tp=2, dp_shard=1, _model=dict(final_norm=False)),
    "tp2_sp_embedding_norm": dict(tp=2, dp_shard=1, _arch="bloom",
                                  _model=dict(position_embedding="rope")),
}
# Every family's architecture on context parallel and on FSDP alone
_FAMILIES = ("gpt2", "neox", "palm", "phi", "bloom", "qwen3")
TWO_RANK.update({f"cp2_{arch}": dict(cp=2, dp_shard=1, _arch=arch) for arch in _FAMILIES})
TWO_RANK.update({f"zero3_2_{arch}": dict(dp_shard=2, _arch=arch) for arch in _FAMILIES})
FOUR_RANK = {
    "zero1_4": dict(dp_shard=4, zero_stage=1),
    "zero2_4": dict(dp_shard=4, zero_stage=2),
    "zero3_4": dict(dp_shard=4, zero_stage=3),
    "hsdp_2x2": dict(dp_replicate=2, dp_shard=2),
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "cp2_tp2": dict(cp=2, tp=2, dp_shard=1),
    "cp2_tp2_alibi": dict(cp=2, tp=2, dp_shard=1, _model=dict(position_embedding="alibi")),
    "cp2_tp2_alibi_docs": dict(cp=2, tp=2, dp_shard=1, _docs=True,
                               _model=dict(position_embedding="alibi")),
    # GQA with 2 kv heads on 4 tp ranks: kv projections replicated, each rank uses one kv head
    "tp4_gqa_kv2": dict(tp=4, dp_shard=1),
    "fsdp2_tp2_compute_loss": dict(dp_shard=2, tp=2, _compute_loss=True),
    # FSDP2 over TP shards of the tied embedding/head and the replicated position table
    "fsdp2_tp2_gpt2": dict(dp_shard=2, tp=2, _arch="gpt2"),
    "fsdp2_tp2_nosp_gpt2": dict(dp_shard=2, tp=2, sequence_parallel=False, _arch="gpt2"),
    "fsdp2_tp2_neox": dict(dp_shard=2, tp=2, _arch="neox"),
    "fsdp2_tp2_palm": dict(dp_shard=2, tp=2, _arch="palm"),
    # PaLM's one kv head kept whole on all 4 tp ranks, its gradient summed over them
    "tp4_sp_palm": dict(tp=4, dp_shard=1, _arch="palm"),
    "fsdp2_tp2_qwen3": dict(dp_shard=2, tp=2, _arch="qwen3"),
    "fsdp2_tp2_phi": dict(dp_shard=2, tp=2, _arch="phi"),
    **{f"cp2_tp2_{arch}": dict(cp=2, tp=2, dp_shard=1, _arch=arch) for arch in _FAMILIES},
}

_CONTROLS: dict = {}


def control_for(layout: dict) -> dict:
    """The one-process run a layout is compared with: same architecture, model overrides,
    clipping and document masking (computed once per distinct one)."""
    key = (layout.get("_arch", "llama"), tuple(sorted(layout.get("_model", {}).items())),
           layout.get("_clip", 0.0), layout.get("_docs", False))
    if key not in _CONTROLS:
        architecture, overrides, clip, docs = key
        _CONTROLS[key] = ladder.run_control(
            architecture=architecture, model_overrides=dict(overrides), clip=clip, docs=docs
        )
    return _CONTROLS[key]


def weight_tol_for(layout: dict) -> float:
    """`WEIGHT_TOL` for the Llama-style model, `GPT2_WEIGHT_TOL` for the other architectures
    (see the module docstring)."""
    if layout.get("_model", {}).get("position_embedding") == "alibi":
        return ALIBI_WEIGHT_TOL
    return WEIGHT_TOL if layout.get("_arch", "llama") == "llama" else GPT2_WEIGHT_TOL


@pytest.fixture(scope="module")
def control():
    return control_for({})


@pytest.fixture(scope="module")
def two_rank_results():
    names = list(TWO_RANK)
    per_rank = run_distributed(ladder.run_many, 2, [TWO_RANK[n] for n in names])
    return {n: [per_rank[r][i] for r in range(2)] for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def four_rank_results():
    names = list(FOUR_RANK)
    per_rank = run_distributed(ladder.run_many, 4, [FOUR_RANK[n] for n in names])
    return {n: [per_rank[r][i] for r in range(4)] for i, n in enumerate(names)}


def assert_matches_control(
    result: dict, control: dict, *, weight_tol: float = WEIGHT_TOL
) -> None:
    losses = torch.tensor(result["losses"])
    torch.testing.assert_close(losses, torch.tensor(control["losses"]), atol=LOSS_TOL, rtol=0)
    assert set(result["weights"]) == set(control["weights"])
    for name, ref in control["weights"].items():
        torch.testing.assert_close(
            result["weights"][name], ref, atol=weight_tol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_rank_layout_matches_control(name, two_rank_results):
    assert_matches_control(two_rank_results[name][0], control_for(TWO_RANK[name]),
                           weight_tol=weight_tol_for(TWO_RANK[name]))
    # every rank reports the same (dp-averaged) losses
    assert two_rank_results[name][0]["losses"] == two_rank_results[name][1]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANK))
def test_four_rank_layout_matches_control(name, four_rank_results):
    assert_matches_control(four_rank_results[name][0], control_for(FOUR_RANK[name]),
                           weight_tol=weight_tol_for(FOUR_RANK[name]))


# Model-state bytes per rank, ZeRO paper (Rajbhandari et al. 2020) §5 with fp32 everywhere:
# 4Ψ bytes of parameters, 4Ψ of gradients, and AdamW's two moments (8Ψ); the ZeRO-1/2 optimizer
# also keeps an fp32 master chunk (the paper's K counts it), so 12Ψ/N there.
ZERO_FORMULAS = {
    # name: (N, params, grads, optimizer) in units of 4Ψ bytes
    "ddp2": (2, lambda n: 1, lambda n: 1, lambda n: 2),
    "zero1_2": (2, lambda n: 1, lambda n: 1, lambda n: 3 / n),
    "zero2_2": (2, lambda n: 1, lambda n: 1 / n, lambda n: 3 / n),
    "zero3_2": (2, lambda n: 1 / n, lambda n: 1 / n, lambda n: 2 / n),
}
FOUR_RANK_FORMULAS = {
    "zero1_4": (4, lambda n: 1, lambda n: 1, lambda n: 3 / n),
    "zero2_4": (4, lambda n: 1, lambda n: 1 / n, lambda n: 3 / n),
    "zero3_4": (4, lambda n: 1 / n, lambda n: 1 / n, lambda n: 2 / n),
}
# Padding: a parameter is split into N chunks of ceil(numel/N) (ZeRO-1/2) or N row blocks of
# ceil(rows/N) (FSDP2), so a rank may hold up to one extra row per parameter: < 1% here.
MEMORY_RTOL = 0.01


def _check_memory(results, control, formulas, name):
    world, f_params, f_grads, f_optim = formulas[name]
    psi_bytes = 4 * sum(w.numel() for w in control["weights"].values())
    for rank_result in results[name]:
        mem = rank_result["memory_after_backward"]
        for measured, formula in (
            (mem.param_bytes, f_params), (mem.grad_bytes, f_grads), (mem.optim_bytes, f_optim)
        ):
            expected = formula(world) * psi_bytes
            assert abs(measured - expected) <= MEMORY_RTOL * expected, (name, measured, expected)


@pytest.mark.parametrize("name", list(ZERO_FORMULAS))
def test_two_rank_memory_matches_zero_formulas(name, two_rank_results, control):
    _check_memory(two_rank_results, control, ZERO_FORMULAS, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANK_FORMULAS))
def test_four_rank_memory_matches_zero_formulas(name, four_rank_results, control):
    _check_memory(four_rank_results, control, FOUR_RANK_FORMULAS, name)


@pytest.mark.slow
def test_one_process_compile_and_selective_checkpointing_match_control(control):
    """On one process parallelize() applies only activation checkpointing and compile."""
    result = ladder.run_layout(0, 1, dict(activation_checkpointing="selective"), compile=True)
    assert_matches_control(result, control)
