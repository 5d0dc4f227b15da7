"""Memory model against published formulas: ZeRO (Rajbhandari et al. 2020) and Korthikanti et
al. 2022; parameter sharding against ``models.sizing``."""

from __future__ import annotations

import numpy as np
import pytest

from densetrain.models import ModelConfig
from densetrain.models.presets import get_preset
from densetrain.models.sizing import param_counts
from densetrain.planner.layout import AC_POLICIES, PP_SCHEDULES
from densetrain.planner.memory import (
    in_flight_layers,
    layer_activation_bytes,
    zero_model_state_bytes,
)
from densetrain.planner.params import check_tensor_parallel, sharded_params
from densetrain.scaling import references as ref

NONE, SELECTIVE, FULL = (AC_POLICIES.index(p) for p in ("none", "selective", "full"))


@pytest.mark.parametrize(
    "stage, published_gb",
    # ZeRO paper, Figure 1 / Table 1: 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12).
    sorted(ref.ZERO_FIGURE1_GB.items()),
)
def test_zero_paper_model_states_for_7_5b_on_64_devices(stage, published_gb):
    params, grads, optim = zero_model_state_bytes(
        ref.ZERO_FIGURE1_PARAMS, ref.ZERO_FIGURE1_DEVICES, stage, 2, 2, 12)
    assert round(float(params + grads + optim) / 1e9, 1) == published_gb


def _gpt(dim: int, heads: int, ffn: int | None = None) -> ModelConfig:
    return ModelConfig(vocab_size=51200, dim=dim, num_layers=4, num_heads=heads, ffn_dim=ffn,
                       activation="gelu", norm_type="layernorm", norm_bias=True,
                       position_embedding="learned", dropout=0.1)


S, B, H, A = (ref.KORTHIKANTI_SHAPE[k] for k in "sbha")  # GPT-3 175B (Korthikanti Table 3)


def _act(cfg, t=1, sp=False, policy=NONE, flash=False, dropout=True):
    return float(layer_activation_bytes(cfg, seq_len=S, micro_batch=B, tp=t, sequence_parallel=sp,
                                        policy=policy, flash_attention=flash, dropout=dropout))


def test_korthikanti_activation_forms():
    cfg = _gpt(H, A)
    sbh = S * B * H
    assert _act(cfg) == pytest.approx(sbh * (34 + 5 * A * S / H), rel=1e-12)
    for t in (2, 4, 8):
        assert _act(cfg, t) == pytest.approx(sbh * (10 + 24 / t + 5 * A * S / (H * t)), rel=1e-12)
        assert _act(cfg, t, sp=True) == pytest.approx(sbh / t * (34 + 5 * A * S / H), rel=1e-12)
        assert _act(cfg, t, policy=SELECTIVE) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
        assert _act(cfg, t, sp=True, policy=SELECTIVE) == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert _act(cfg, policy=FULL) == pytest.approx(2 * sbh, rel=1e-12)


def test_activation_generalisations_shrink_in_the_expected_direction():
    gpt = _gpt(1024, 16)
    # Without dropout: no masks (2 sbh) and the softmax output doubles as the AV input.
    no_dropout = _act(gpt, dropout=False)
    sbh = S * B * 1024
    assert no_dropout == pytest.approx(sbh * 32 + 2 * 16 * S * S * B, rel=1e-12)
    # FlashAttention keeps only a fp32 log-sum-exp per head instead of the s x s scores.
    assert _act(gpt, flash=True, dropout=False) == pytest.approx(sbh * 32 + 4 * 16 * S * B)
    llama = get_preset("llama3-8b")
    gqa = _act(llama, flash=True, dropout=False)
    # q, k (GQA width), v, wo input, gate, up and their product (silu(gate) recomputed), 2 norm
    # inputs, 2 normed inputs, lse.
    e, d = 2, llama.dim
    expected = S * B * e * (2 * llama.q_dim + 2 * llama.kv_dim + 3 * llama.ffn_dim + 4 * d)
    assert gqa == pytest.approx(expected + 4 * llama.num_heads * S * B, rel=1e-12)


def test_pipeline_in_flight_microbatches():
    layers = 80
    one_f, gpipe, inter = (PP_SCHEDULES.index(s) for s in ("1f1b", "gpipe", "interleaved_1f1b"))
    # 1F1B: the first stage holds pp microbatches of L/pp layers = L layers (Korthikanti 4.2.3).
    assert in_flight_layers(layers // 8, 8, one_f, 1, 32) == layers
    assert in_flight_layers(layers // 8, 8, one_f, 1, 4) == layers // 8 * 4
    assert in_flight_layers(layers // 8, 8, gpipe, 1, 32) == layers // 8 * 32
    assert in_flight_layers(layers // 8, 8, inter, 2, 32) == pytest.approx(
        layers * (1 + 7 / 16))
    assert in_flight_layers(layers, 1, one_f, 1, 32) == layers


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2-124m", "palm-540b", "bloom-560m",
                                  "opt-350m", "phi-1", "qwen3-0.6b", "gpt-neox-20b"])
def test_tensor_parallel_shards_sum_to_the_sizing_count(name):
    cfg = get_preset(name)
    assert sharded_params(cfg, 1).total() == param_counts(cfg).total
    for pp in (1, 2, 4):
        stages = sharded_params(cfg, 1).stage_params(pp)
        tied_copy = sharded_params(cfg, 1).tied_output if pp > 1 else 0
        assert sum(stages) == param_counts(cfg).total + tied_copy


def test_tensor_parallel_split_rules():
    cfg = ModelConfig(vocab_size=1001, dim=64, num_layers=2, num_heads=8, num_kv_heads=2,
                      ffn_dim=96, activation="swiglu")
    one, four = sharded_params(cfg, 1), sharded_params(cfg, 4)
    kv = 2 * cfg.kv_dim * cfg.dim  # wk + wv stay whole: 2 kv heads < tp = 4
    split = cfg.q_dim * cfg.dim * 2 + 3 * cfg.ffn_dim * cfg.dim
    assert one.per_layer == kv + split + 2 * cfg.dim
    assert four.per_layer == kv + split // 4 + 2 * cfg.dim
    assert four.first_stage_extra == 251 * cfg.dim  # ceil(1001 / 4) vocab rows
    assert check_tensor_parallel(cfg, 3) is not None
    with pytest.raises(ValueError, match="num_heads"):
        sharded_params(cfg, 16)


def test_memory_columns_vectorised_matches_rows():
    from densetrain.planner.layout import Layout, LayoutColumns, PlanSettings
    from densetrain.planner.memory import memory_columns

    cfg = get_preset("llama3-8b")
    layouts = [Layout(tp=8, sequence_parallel=True, dp_shard=4, zero_stage=3),
               Layout(pp=4, dp_replicate=8, activation_checkpointing="full", micro_batch_size=2)]
    together = memory_columns(cfg, 8192, 64, LayoutColumns.from_layouts(layouts), PlanSettings())
    for i, lay in enumerate(layouts):
        alone = memory_columns(cfg, 8192, 64, LayoutColumns.from_layouts([lay]), PlanSettings())
        assert together["total"][i] == pytest.approx(float(alone["total"][0]))
    assert np.all(together["total"] > 0)


def saved_bytes_per_layer(base: dict, seq: int, batch: int, dtype: str = "bfloat16") -> float:
    """Bytes autograd saves per decoder layer in a forward (in ``dtype``) of the real
    ``Transformer`` (the difference between a 4- and a 2-layer model, halved; storages
    counted once, parameters not counted)."""
    import torch

    from densetrain.models import Transformer

    totals = []
    for layers in (2, 4):
        model = Transformer(ModelConfig(num_layers=layers, **base))
        model.init_weights(seed=0)
        model = model.to(getattr(torch, dtype))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t, params=params, storages=storages):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, base["vocab_size"], (batch, seq),
                               generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.forward_hidden(tokens)
        totals.append(sum(storages.values()))
    return (totals[1] - totals[0]) / 2


def test_activation_model_matches_what_autograd_saves():
    # LayerNorm (a fused kernel on CPU too), SwiGLU, GQA and SDPA's flash kernel: every stored
    # tensor of the model is counted. (CPU's eager RMSNorm also keeps fp32 copies of its input;
    # CUDA's fused RMSNorm, which the planner targets, does not.)
    base = dict(vocab_size=512, dim=256, num_heads=4, num_kv_heads=2, ffn_dim=512,
                activation="swiglu", norm_type="layernorm")
    seq, batch = 256, 2
    measured = saved_bytes_per_layer(base, seq, batch)
    predicted = float(layer_activation_bytes(
        ModelConfig(num_layers=2, **base), seq_len=seq, micro_batch=batch, tp=1,
        sequence_parallel=False, policy=NONE, flash_attention=True, dropout=False))
    assert measured == pytest.approx(predicted, rel=0.01)
