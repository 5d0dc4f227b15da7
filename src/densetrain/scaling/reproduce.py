"""densetrain's own values for the published numbers of ``scaling.references``: each function
computes one of them from densetrain's formulas, as the test named beside the reference does."""

from __future__ import annotations

from densetrain.models.config import ModelConfig


def palm_540b_config() -> ModelConfig:
    """PaLM 540B, Chowdhery et al. 2022 Table 1: 118 layers, d 18432, 48 heads of 256, MQA,
    SwiGLU with ffn 4·d, 256k vocab, tied, no biases, parallel block."""
    return ModelConfig(vocab_size=256000, dim=18432, num_layers=118, num_heads=48,
                       num_kv_heads=1, head_dim=256, ffn_dim=4 * 18432, activation="swiglu",
                       tie_embeddings=True, block_type="parallel", parallel_shared_norm=True,
                       norm_type="layernorm", max_seq_len=2048)


def gpt3_175b_config() -> ModelConfig:
    """GPT-3 175B, Brown et al. 2020 Table 2.1: 96 layers, d 12288, 96 heads, ctx 2048."""
    return ModelConfig(vocab_size=50257, dim=12288, num_layers=96, num_heads=96,
                       max_seq_len=2048, position_embedding="learned", norm_type="layernorm",
                       norm_bias=True, activation="gelu", qkv_bias=True, attn_out_bias=True,
                       mlp_bias=True, tie_embeddings=True)


def palm_540b_params() -> float:
    """Total parameters of PaLM 540B by ``sizing.param_counts``."""
    from densetrain.models.sizing import param_counts

    return float(param_counts(palm_540b_config()).total)


def palm_540b_mfu(tokens_per_s: float, chips: int, peak_flops: float) -> float:
    """MFU of PaLM's published throughput with densetrain's FLOPs per token (PaLM App. B)."""
    from densetrain.models.sizing import flops_per_token_palm

    per_token = flops_per_token_palm(palm_540b_config(), 2048)
    return per_token * tokens_per_s / (chips * peak_flops)


def gpt3_175b_params() -> float:
    """Total parameters of GPT-3 175B by ``sizing.param_counts``."""
    from densetrain.models.sizing import param_counts

    return float(param_counts(gpt3_175b_config()).total)


def gpt3_175b_training_flops(train_tokens: float) -> float:
    """6·N·D over the training tokens with N = ``sizing.matmul_params``."""
    from densetrain.models.sizing import matmul_params

    return 6.0 * matmul_params(gpt3_175b_config()) * train_tokens


def chinchilla_a4_ratio(layers: int, d_model: int, ffw: int, heads: int) -> float:
    """Appendix F's layer FLOPs over 6·N with the paper's N (ours plus Transformer-XL
    relative-position weights d² + 2d per layer plus the output matrix), seq 2048, vocab 32000."""
    from densetrain.models.sizing import chinchilla_flops_breakdown, param_counts

    cfg = ModelConfig(vocab_size=32000, dim=d_model, num_layers=layers, num_heads=heads,
                      ffn_dim=ffw, activation="gelu", norm_type="layernorm", norm_bias=True,
                      qkv_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True)
    n_params = (param_counts(cfg).non_embedding + layers * (d_model**2 + 2 * d_model)
                + 32000 * d_model)
    terms = chinchilla_flops_breakdown(cfg, 2048)
    return 3 * (terms.attention + terms.dense) / (6 * n_params)


def zero_model_state_gb(params: float, devices: int, stage: int) -> float:
    """Model-state GB per device by ``planner.memory.zero_model_state_bytes`` (2+2+12 bytes)."""
    from densetrain.planner.memory import zero_model_state_bytes

    p, g, o = zero_model_state_bytes(params, devices, stage, 2, 2, 12)
    return float(p + g + o) / 1e9


def korthikanti_eq1(*, s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022 eq. 1: activation bytes per layer sbh·(34 + 5as/h)."""
    return s * b * h * (34 + 5 * a * s / h)


def gpt3_layer_activation_bytes(shape: dict[str, int]) -> float:
    """``planner.memory.layer_activation_bytes`` for a GPT-3 175B layer of ``shape`` (s, b, h,
    a; dropout, no flash, no recompute, no parallelism)."""
    from densetrain.planner.layout import AC_POLICIES
    from densetrain.planner.memory import layer_activation_bytes

    cfg = ModelConfig(vocab_size=51200, dim=shape["h"], num_layers=4, num_heads=shape["a"],
                      activation="gelu", norm_type="layernorm", norm_bias=True,
                      position_embedding="learned", dropout=0.1)
    return float(layer_activation_bytes(
        cfg, seq_len=shape["s"], micro_batch=shape["b"], tp=1, sequence_parallel=False,
        policy=AC_POLICIES.index("none"), flash_attention=False, dropout=True))


def chinchilla_nopt(flops: float) -> float:
    """N_opt of the shared ``compute_optimal`` (unrounded approach 3 constants)."""
    from densetrain.scaling.optimal import compute_optimal

    return compute_optimal(flops).num_params


def chinchilla_params_exponent() -> float:
    """a = β/(α+β) of the unrounded approach 3 law."""
    from densetrain.scaling.laws import CHINCHILLA_UNROUNDED
    from densetrain.scaling.optimal import chinchilla_optimal_laws

    return chinchilla_optimal_laws(CHINCHILLA_UNROUNDED)[0].exponent


def kaplan_exponent(name: str) -> float:
    """Exponent ``name`` (N, B, S, D) of Kaplan eqs. 1.7-1.8 with the published α values."""
    from densetrain.scaling.laws import KAPLAN_ALPHA_B, KAPLAN_ALPHA_N, KAPLAN_ALPHA_S
    from densetrain.scaling.optimal import kaplan_allocation_exponents

    return kaplan_allocation_exponents(KAPLAN_ALPHA_N, KAPLAN_ALPHA_B, KAPLAN_ALPHA_S)[name]
