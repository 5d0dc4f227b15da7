"""What one layer keeps for backward, traced at real size (`dryrun.layer`), against counts
written here from the tensor shapes of each published layer (not from the planner).

Per micro-batch of b sequences of s tokens, on one of t tensor-parallel ranks with sequence
parallelism, activations in bf16 (2 bytes), flash attention (its fp32 log-sum-exp, one value
per head and token):

- "none": the layer input and the two norm outputs as sequence shards (the all-gathered copies
  are made again in backward), Q/K/V, the attention output, the reduced attention output (the
  MLP norm's input), the MLP's matmul outputs and activation;
- "selective" (norms and the MLP activation recomputed): "none" less the norm outputs and the
  activation;
- "full": the layer input.

For GPT-3 "none" is Korthikanti et al. 2022, Eq. 4 with sequence parallelism, sbh(34/t +
5as/(ht)) bytes, less the two dropout masks (sbh/t each: GPT-3's dropout is 0 here) and the
5as/(ht) attention scores that flash attention never stores: 32·sbh/t, plus the log-sum-exp.
"""

from __future__ import annotations

import pytest

from densetrain.dryrun.layer import layer_activation_bytes
from densetrain.models.presets import get_preset

BF16, FP32 = 2, 4


def _llama_counts(h: int, ffn: int, heads: int, kv_heads: int, head_dim: int, s: int, t: int):
    shard = s * h // t * BF16                          # one residual-stream shard
    q = s * heads * head_dim // t * BF16
    kv_local = max(kv_heads // t, 1) * head_dim       # GQA: kv heads split, else one per rank
    k = v = s * kv_local * BF16
    lse = s * heads // t * FP32
    gate = up = product = s * ffn // t * BF16
    rstd = s // t * FP32                               # RMSNorm's 1/rms per token, per norm
    selective = shard + q + k + v + q + lse + shard + gate + up
    none = selective + 2 * (shard + rstd) + product
    return {"none": none, "selective": selective, "full": shard}


def _gpt3_counts(h: int, ffn: int, heads: int, s: int, t: int):
    shard = s * h // t * BF16
    lse = s * heads // t * FP32
    ln_stats = 2 * s // t * FP32                       # LayerNorm's mean and 1/std per token
    up = gelu = s * ffn // t * BF16
    korthikanti = (34 - 2) * shard // BF16             # Eq. 4 less dropout masks and scores
    none = korthikanti + lse + 2 * ln_stats
    assert none == shard + 3 * shard + shard + lse + shard + up + gelu + 2 * (shard + ln_stats)
    selective = shard + 3 * shard + shard + lse + shard + up
    return {"none": none, "selective": selective, "full": shard}


def _parallel_block_counts(h: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
                           s: int, t: int, *, shared_norm: bool, swiglu: bool, sp: bool):
    """A parallel attention + MLP block with LayerNorm (PaLM: one shared norm, MQA, SwiGLU;
    GPT-NeoX: two norms, GELU): its two branches read the same input and their sum is reduced
    once, by the residual add alone, so no reduced output is kept."""
    shard = s * h // (t if sp else 1) * BF16          # the layer input (its shard under SP)
    rows = s // t if sp else s
    ln_stats = 2 * rows * FP32                          # mean and 1/std per token, per norm
    norms = 1 if shared_norm else 2
    q = s * heads * head_dim // t * BF16
    kv_local = max(kv_heads // t, 1) * head_dim        # MQA: the one kv head whole per rank
    k = v = s * kv_local * BF16
    lse = s * heads // t * FP32
    mlp = s * ffn // t * BF16                           # each of up (, gate) and the product
    matmuls = q + k + v + q + lse + (2 if swiglu else 1) * mlp
    selective = shard + matmuls
    none = selective + norms * (shard + ln_stats) + mlp
    return {"none": none, "selective": selective, "full": shard}


# PaLM 540B in its 12-way model parallel without sequence parallelism (12 does not divide the
# 2,048 tokens); GPT-NeoX-20B in its TP 2, here with sequence parallelism
PALM_540B = _parallel_block_counts(18432, 73728, 48, 1, 256, 2048, 12, shared_norm=True,
                                   swiglu=True, sp=False)
NEOX_20B = _parallel_block_counts(6144, 24576, 64, 64, 96, 2048, 2, shared_norm=False,
                                  swiglu=False, sp=True)
LLAMA3_8B = _llama_counts(4096, 14336, 32, 8, 128, 8192, 8)
GPT3_175B = _gpt3_counts(12288, 49152, 96, 2048, 8)
LLAMA3_405B = _llama_counts(16384, 53248, 128, 8, 128, 8192, 8)


def _check(preset: str, seq_len: int, mode: str, expected: int, *, tp: int = 8,
           sequence_parallel: bool = True) -> None:
    traced = layer_activation_bytes(get_preset(preset), tp=tp, mode=mode, seq_len=seq_len,
                                    sequence_parallel=sequence_parallel)
    assert traced.kept_bytes == pytest.approx(expected, rel=0.01), (
        f"{preset} {mode}: traced {traced.kept_bytes / 2**20:.2f} MiB, "
        f"analytic {expected / 2**20:.2f} MiB")


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_llama3_layer_keeps_the_analytic_count(mode):
    _check("llama3-8b", 8192, mode, LLAMA3_8B[mode])


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_gpt3_layer_keeps_korthikantis_count_without_dropout(mode):
    _check("gpt3-175b", 2048, mode, GPT3_175B[mode])


def test_memory_notes_llama3_405b_figures():
    # the per-layer figures of the Llama 3 405B reference (508.5 MiB without recomputation,
    # 340.5 with the norms and SwiGLU product recomputed, 32 MiB full), from the shapes
    mib = 2**20
    assert LLAMA3_405B["none"] // mib == 508 and LLAMA3_405B["selective"] // mib == 340
    assert LLAMA3_405B["full"] == 32 * mib


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_llama3_405b_layer_keeps_the_analytic_count(mode):
    _check("llama3-405b", 8192, mode, LLAMA3_405B[mode])


def test_attention_recomputed_drops_the_attention_output():
    traced = layer_activation_bytes(get_preset("llama3-8b"), tp=8, mode="selective",
                                    seq_len=8192, recompute=("norms", "mlp_activation",
                                                             "attention"))
    s, t = 8192, 8
    attention_out = s * 4096 // t * BF16 + s * 32 // t * FP32
    assert traced.kept_bytes == pytest.approx(LLAMA3_8B["selective"] - attention_out, rel=0.01)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_neox_parallel_block_keeps_the_analytic_count(mode):
    _check("gpt-neox-20b", 2048, mode, NEOX_20B[mode], tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_palm_540b_parallel_block_keeps_the_analytic_count(mode):
    _check("palm-540b", 2048, mode, PALM_540B[mode], tp=12, sequence_parallel=False)


@pytest.mark.parametrize("preset, tp, sp, counts", [
    ("gpt-neox-20b", 2, True, NEOX_20B), ("palm-540b", 12, False, PALM_540B)])
def test_planner_counts_parallel_blocks_as_the_shapes(preset, tp, sp, counts):
    """The planner's per-layer count (`planner.memory`) equals the analytic one for parallel
    blocks in every mode (it counted the sequential block's two norm inputs and its kept
    attention reduction: 1.07x and 1.55x under "selective")."""
    import numpy as np

    from densetrain.planner.layout import AC_POLICIES
    from densetrain.planner.memory import layer_activation_bytes as planned

    for mode, expected in counts.items():
        value = planned(get_preset(preset), seq_len=2048, micro_batch=1, tp=tp,
                        sequence_parallel=sp, policy=np.array([AC_POLICIES.index(mode)]),
                        flash_attention=True, dropout=False, selective_keeps_matmul_outputs=True)
        assert float(value[0]) == pytest.approx(expected, rel=0.001), mode
