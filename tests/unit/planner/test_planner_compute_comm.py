"""FLOPs, MFU, communication volumes and the step-time model against published numbers and
closed forms."""

from __future__ import annotations

import dataclasses

import pytest

from densetrain.models.presets import get_preset
from densetrain.models.sizing import flops_per_token_palm, param_counts
from densetrain.planner.compute import mfu, recompute_flops_per_token, stage_imbalance
from densetrain.planner.hardware import get_cluster
from densetrain.planner.layout import AC_POLICIES, Layout, PlanSettings
from densetrain.planner.search import evaluate_layout
from densetrain.scaling import references as ref


def test_palm_mfu_from_published_numbers():
    # PaLM (Chowdhery et al. 2022, Table 3 and Appendix B): 238.3K tokens/s on 6144 TPU v4
    # chips at 275 TFLOP/s; 6N + 12LHQT with N = 540.35B, L = 118, H = 48, Q = 256, T = 2048.
    per_token = 6 * ref.PALM_540B_PARAMS + 12 * 118 * 48 * 256 * 2048
    assert round(mfu(ref.PALM_TOKENS_PER_S, per_token, ref.PALM_CHIPS,
                     ref.TPU_V4_PEAK_FLOPS), 3) == ref.PALM_MFU
    palm = get_preset("palm-540b")
    per_token = flops_per_token_palm(palm, 2048)
    cluster = get_cluster("tpu-v4")
    assert round(mfu(ref.PALM_TOKENS_PER_S, per_token, ref.PALM_CHIPS, cluster.peak_flops),
                 3) == ref.PALM_MFU


def test_recompute_flops():
    cfg = get_preset("llama3-8b")
    s = 4096
    attention_fwd = 4 * cfg.num_layers * s * cfg.q_dim
    full = AC_POLICIES.index("full")
    selective = AC_POLICIES.index("selective")
    expected_full = 2 * param_counts(cfg).non_embedding + attention_fwd
    assert float(recompute_flops_per_token(cfg, s, full, True)) == expected_full
    assert float(recompute_flops_per_token(cfg, s, selective, False)) == attention_fwd
    assert float(recompute_flops_per_token(cfg, s, selective, True)) == 0.0
    # Full recompute re-runs about a third of the layers' work (the forward).
    ratio = (flops_per_token_palm(cfg, s) + expected_full) / flops_per_token_palm(cfg, s)
    assert 1.25 < ratio < 4 / 3
    # torch's non-reentrant checkpoint does not re-run a pre-norm block's down projection; with
    # residual dropout (its mask needs that output) or post-norm it must.
    down = 2 * cfg.num_layers * cfg.dim * cfg.ffn_dim
    assert float(recompute_flops_per_token(cfg, s, full, True, early_stop=True)) == (
        expected_full - down)
    for changed in (cfg.replace(dropout=0.1), cfg.replace(norm_position="post")):
        assert float(recompute_flops_per_token(changed, s, full, True, early_stop=True)) == (
            float(recompute_flops_per_token(changed, s, full, True)))


def test_stage_imbalance_counts_the_output_layer_on_the_last_stage():
    cfg = get_preset("llama3-8b")
    assert float(stage_imbalance(cfg, 4096, 1)) == 1.0
    assert 1.0 < float(stage_imbalance(cfg, 4096, 8)) < 1.5


def _eval(layout: Layout, *, batch: int = 64, seq: int = 4096, precision: str = "fp32",
          cluster: str = "h100", settings: PlanSettings | None = None):
    cfg = get_preset("llama3-8b")
    settings = settings or PlanSettings()
    return evaluate_layout(cfg, seq, batch, layout, get_cluster(cluster),
                           dataclasses.replace(settings, precision=precision))


def test_dp_volume_by_zero_stage_matches_the_zero_paper():
    # ZeRO paper sec. 7: stages 1 and 2 move 2 Psi per step like DP's all-reduce; stage 3 3 Psi.
    psi = param_counts(get_preset("llama3-8b")).total
    n = 64
    ring = (n - 1) / n
    dp = _eval(Layout(dp_replicate=n, micro_batch_size=1), batch=n)
    assert dp["dp_bytes"] == pytest.approx(2 * ring * psi * 4)
    for stage in (1, 2):
        z = _eval(Layout(dp_shard=n, zero_stage=stage), batch=n)
        assert z["dp_bytes"] == pytest.approx(dp["dp_bytes"])
    z3 = _eval(Layout(dp_shard=n, zero_stage=3), batch=n)
    assert z3["dp_bytes"] == pytest.approx(1.5 * dp["dp_bytes"])


def test_tp_volume_is_four_all_reduces_per_layer_and_microbatch():
    cfg = get_preset("llama3-8b")
    t, seq, batch = 8, 4096, 4
    row = _eval(Layout(tp=t, micro_batch_size=1, dp_replicate=1), batch=batch, seq=seq)
    act = seq * cfg.dim * 2
    expected = batch * (4 * cfg.num_layers + 2) * 2 * (t - 1) / t * act
    assert row["tp_bytes"] == pytest.approx(expected)
    # Megatron-LM's sequence parallelism: the same volume (Korthikanti et al. 2022 §4.2.2)
    with_sp = _eval(Layout(tp=t, sequence_parallel=True), batch=batch, seq=seq,
                    settings=PlanSettings(selective_keeps_matmul_outputs=False))
    assert with_sp["tp_bytes"] == pytest.approx(expected)
    # the trainer's block policy also gathers each layer's two normed sequence shards again in
    # backward: one all-reduce's worth more per layer
    trainer_sp = _eval(Layout(tp=t, sequence_parallel=True), batch=batch, seq=seq)
    assert trainer_sp["tp_bytes"] == pytest.approx(
        batch * (5 * cfg.num_layers + 2) * 2 * (t - 1) / t * act)
    assert with_sp["mem_activations"] < row["mem_activations"]


def test_groups_beyond_a_node_use_the_network():
    inside = _eval(Layout(tp=8), batch=4)
    across = _eval(Layout(tp=16), batch=4)
    h100 = get_cluster("h100")
    collectives = 4 * (4 * 32 + 2)  # microbatches x (4 per layer + embedding + output)
    # Each all-reduce moves one b*s*h activation (2 bytes): its bandwidth is the link's
    # x collective_efficiency x S / (S + half), plus a latency of 2 log2(tp) steps.
    payload = 4096 * 4096 * PlanSettings().activation_bytes
    share = h100.collective_efficiency * payload / (payload + h100.collective_half_bytes)
    assert 0.5 < share < 1
    assert inside["tp_s"] == pytest.approx(
        inside["tp_bytes"] / (h100.intra_node_bytes_per_s * share)
        + collectives * h100.intra_node_latency_s * 2 * 3)
    # tp 16 exceeds Llama 3 8B's 8 kv heads: wk and wv are replicated and their gradients
    # all-reduced over tp in every backward, two [kv_dim, dim] bf16 payloads per layer
    kv_payload = 1024 * 4096 * PlanSettings().activation_bytes
    kv_share = h100.collective_efficiency * kv_payload / (kv_payload + h100.collective_half_bytes)
    kv_calls = 4 * 2 * 32
    kv_bytes = kv_calls * 2 * 15 / 16 * kv_payload
    activation_bytes = collectives * 2 * 15 / 16 * payload
    assert across["tp_bytes"] == pytest.approx(activation_bytes + kv_bytes)
    assert across["tp_s"] == pytest.approx(
        activation_bytes / (h100.inter_node_bytes_per_s * share)
        + collectives * h100.inter_node_latency_s * 2 * 4
        + kv_bytes / (h100.inter_node_bytes_per_s * kv_share)
        + kv_calls * h100.inter_node_latency_s * 2 * 4)


def test_a_collective_reaches_half_its_bandwidth_at_the_half_payload():
    from densetrain.planner.comm import link

    a100 = get_cluster("a100")
    half = a100.collective_half_bytes
    bandwidth, _ = link(a100, 8, [half, 1e12])
    # nccl-tests on an A100 node: 235 GB/s of the 300 GB/s NVLink (hardware.py cites it).
    assert bandwidth[1] == pytest.approx(235e9, rel=1e-3)
    assert bandwidth[0] == pytest.approx(235e9 / 2, rel=1e-6)


def test_bubble_and_mfu_follow_their_definitions():
    layout = Layout(pp=4, dp_shard=2, zero_stage=3, micro_batch_size=1)
    row = _eval(layout, batch=16)
    m = 16 // 2
    assert row["bubble_s"] == pytest.approx(
        3 / m * (row["compute_s"] + row["tp_exposed_s"] + row["cp_exposed_s"]))
    inter = _eval(Layout(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                         dp_shard=2, zero_stage=3), batch=16)
    assert inter["bubble_s"] == pytest.approx(row["bubble_s"] / 2, rel=0.01)
    devices = layout.devices
    h100 = get_cluster("h100")
    assert row["mfu"] == pytest.approx(
        row["model_flops_per_step"] / (row["step_s"] * devices * h100.peak_flops))
    parts = ("compute_s", "bubble_s", "tp_exposed_s", "pp_exposed_s", "cp_exposed_s",
             "dp_exposed_s", "optimizer_s", "host_s")
    assert row["step_s"] == pytest.approx(sum(row[p] for p in parts))
    assert row["host_s"] == 0.0  # a GPU's host runs ahead of the device


def test_host_time_per_layer_and_microbatch():
    from densetrain.planner.hardware import with_overrides

    cluster = with_overrides(get_cluster("h100"), layer_host_s=1e-3, tp_layer_host_s=5e-3,
                             fsdp_layer_host_s=2e-3, optimizer_layer_host_s=1e-4,
                             tp_optimizer_layer_host_s=4e-4, fsdp_optimizer_layer_host_s=3e-4)
    cfg = get_preset("llama3-8b")

    def host(**layout):
        return evaluate_layout(cfg, 4096, 16, Layout(micro_batch_size=2, **layout), cluster,
                               PlanSettings())["host_s"]

    # 32 layers x (8 microbatches x the per-layer figure + the optimizer's per-layer figure).
    assert host() == pytest.approx(32 * (8 * 1e-3 + 1e-4))
    assert host(tp=2) == pytest.approx(32 * (8 * 5e-3 + 4e-4))
    # FSDP over 2: 4 microbatches per rank; with tp as well, both extras add up.
    assert host(dp_shard=2, zero_stage=3) == pytest.approx(32 * (4 * 2e-3 + 3e-4))
    assert host(tp=2, dp_shard=2, zero_stage=3) == pytest.approx(
        32 * (4 * (1e-3 + 4e-3 + 1e-3) + (1e-4 + 3e-4 + 2e-4)))
    # Full recompute runs the forward again (a third of the forward + backward).
    assert host(activation_checkpointing="full") == pytest.approx(32 * (8 * 1e-3 * 4 / 3 + 1e-4))


def test_bad_layouts_are_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="dp_shard=1"):
        Layout(zero_stage=0, dp_shard=2)
    with pytest.raises(ValueError, match="pp_schedule"):
        Layout(pp_schedule="zigzag")
    with pytest.raises(ValueError, match="global batch"):
        _eval(Layout(dp_replicate=3), batch=64)
    with pytest.raises(ValueError, match="num_heads"):
        _eval(Layout(tp=64), batch=64)
