"""Sizing formulas against meta-built models and published figures."""

from __future__ import annotations

import itertools

import pytest
import torch

from densetrain.models import ModelConfig, Transformer
from densetrain.models.sizing import (
    chinchilla_flops_breakdown,
    flops_per_token_chinchilla,
    flops_per_token_palm,
    kv_cache_bytes_per_token,
    matmul_params,
    param_counts,
)
from densetrain.scaling import references as ref

COMBOS = list(
    itertools.product(
        ["rmsnorm", "layernorm"],
        [True, False],  # norm type, bias flags
        ["rope", "learned", "alibi"],
        ["swiglu", "gelu"],
        ["sequential", "parallel"],
        [True, False],  # tied
    )
)


@pytest.mark.parametrize("norm,bias,pos,act,block,tied", COMBOS)
def test_param_counts_equal_meta_built_model(norm, bias, pos, act, block, tied):
    cfg = ModelConfig(
        vocab_size=1000,
        vocab_pad_multiple=64,
        dim=96,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2 if pos == "rope" else 6,
        head_dim=24 if tied else None,
        ffn_dim=200,
        norm_type=norm,
        norm_bias=bias,
        position_embedding=pos,
        learned_pos_offset=2,
        activation=act,
        block_type=block,
        parallel_shared_norm=block == "parallel" and tied,
        tie_embeddings=tied,
        qkv_bias=bias,
        attn_out_bias=not bias,
        mlp_bias=bias,
        qk_norm=bias,
        embedding_norm=not bias,
        lm_head_bias=bias and not tied,
        embed_dim=48 if (tied and not bias) else None,
        final_norm=block == "sequential",
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    if model.pos_embeddings is not None:
        embedding += model.pos_embeddings.weight.numel()
    if not tied:
        embedding += model.output.weight.numel()
    assert counts.embedding == embedding
    assert counts.non_embedding == counts.total - embedding


# Hoffmann et al. 2022, Table A4: (layers, d_model, ffw_size, heads) and the published ratio of
# the detailed FLOP count to 6·N·D, for seq_len 2048 and vocab 32000.
TABLE_A4 = list(ref.CHINCHILLA_TABLE_A4)


@pytest.mark.parametrize("layers,d_model,ffw,heads,ratio", TABLE_A4)
def test_chinchilla_table_a4_ratios(layers, d_model, ffw, heads, ratio):
    """The appendix's per-layer terms reproduce Table A4 (to its two decimals) when, as in the
    table, the comparison covers the transformer layers and N is the paper's parameter count:
    ours (biases, LayerNorms) plus Transformer-XL relative-position weights (d² + 2d per
    layer, Rae et al. 2021) plus the output matrix. This N reproduces the table's sizes
    (73M, 305M, 552M, 1.1B, 1.6B, 6.8B)."""
    cfg = ModelConfig(
        vocab_size=32000,
        dim=d_model,
        num_layers=layers,
        num_heads=heads,
        ffn_dim=ffw,
        activation="gelu",
        norm_type="layernorm",
        norm_bias=True,
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
    )
    n_params = (
        param_counts(cfg).non_embedding + layers * (d_model**2 + 2 * d_model) + 32000 * d_model
    )
    terms = chinchilla_flops_breakdown(cfg, 2048)
    detailed = 3 * (terms.attention + terms.dense)
    assert round(detailed / (6 * n_params), 2) == ratio
    full = flops_per_token_chinchilla(cfg, 2048)
    assert full == pytest.approx(3 * (terms.attention + terms.dense + 2 * 2 * 32000 * d_model))


def palm_540b() -> ModelConfig:
    """PaLM 540B, Chowdhery et al. 2022 Table 1: 118 layers, d 18432, 48 heads of 256, MQA,
    SwiGLU with ffn 4·d, 256k vocab, tied, no biases, parallel block."""
    return ModelConfig(
        vocab_size=256000,
        dim=18432,
        num_layers=118,
        num_heads=48,
        num_kv_heads=1,
        head_dim=256,
        ffn_dim=4 * 18432,
        activation="swiglu",
        tie_embeddings=True,
        block_type="parallel",
        parallel_shared_norm=True,
        norm_type="layernorm",
        max_seq_len=2048,
    )


def test_palm_540b_size_and_published_mfu():
    cfg = palm_540b()
    assert param_counts(cfg).total == pytest.approx(ref.PALM_540B_PARAMS, rel=1e-3)  # 540.35B
    # PaLM §4 / Table 3: 238.3k tokens/s on 6144 TPU v4 chips (275 TFLOP/s bf16 peak) is 46.2%
    # model FLOPs utilisation, with FLOPs per token from Appendix B's 6N + 12·L·H·Q·T.
    mfu = flops_per_token_palm(cfg, 2048) * ref.PALM_TOKENS_PER_S / (
        ref.PALM_CHIPS * ref.TPU_V4_PEAK_FLOPS)
    assert mfu == pytest.approx(ref.PALM_MFU, abs=0.0005)


def test_gpt3_175b_training_compute():
    """GPT-3 175B (Brown et al. 2020 Table 2.1; 96 layers, d 12288, 96 heads, ctx 2048): the
    6N·D part of the PaLM count over 300B tokens is Table D.1's 3.14e23 FLOPs."""
    cfg = ModelConfig(
        vocab_size=50257,
        dim=12288,
        num_layers=96,
        num_heads=96,
        max_seq_len=2048,
        position_embedding="learned",
        norm_type="layernorm",
        norm_bias=True,
        activation="gelu",
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
    )
    assert param_counts(cfg).total == pytest.approx(ref.GPT3_175B_PARAMS, rel=5e-3)
    assert 6 * matmul_params(cfg) * ref.GPT3_TRAIN_TOKENS == pytest.approx(
        ref.GPT3_TRAIN_FLOPS, rel=5e-3)
    attention = 12 * 96 * 96 * 128 * 2048
    assert flops_per_token_palm(cfg, 2048) == 6 * matmul_params(cfg) + attention


def test_palm_formula_pieces_and_sliding_window():
    cfg = ModelConfig(vocab_size=1000, dim=64, num_layers=2, num_heads=4, sliding_window=100)
    n = param_counts(cfg).non_embedding + 1000 * 64
    assert flops_per_token_palm(cfg, 64) == 6 * n + 12 * 2 * 4 * 16 * 64
    assert flops_per_token_palm(cfg, 4096) == 6 * n + 12 * 2 * 4 * 16 * 100
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token_palm(cfg, 0)


def test_kv_cache_bytes():
    """Llama 2 7B (32 layers, 32 kv heads of 128): 0.5 MiB per token in fp16; Llama 2 70B
    (80 layers, 8 kv heads of 128): 320 KiB."""
    llama2_7b = ModelConfig(vocab_size=32000, dim=4096, num_layers=32, num_heads=32, ffn_dim=11008)
    assert kv_cache_bytes_per_token(llama2_7b) == 512 * 1024
    llama2_70b = ModelConfig(
        vocab_size=32000, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672
    )
    assert kv_cache_bytes_per_token(llama2_70b, bytes_per_elem=2) == 320 * 1024
    assert kv_cache_bytes_per_token(llama2_70b, bytes_per_elem=4) == 640 * 1024
