"""Qwen3 dense models (Qwen Team 2025, Table 1): 0.6B, 1.7B, 4B, 8B, 14B and 32B.

Pre-RMSNorm, GQA with 8 kv heads, head_dim 128 independent of the width, QK-RMSNorm, RoPE theta
1e6, SwiGLU; 0.6B-4B tie their embeddings. Shapes are those of the released ``config.json``
(context 40960); counts equal ``Qwen3ForCausalLM``'s exactly.
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig
from densetrain.models.presets._table import presets_from_table


def qwen3_config(
    *,
    dim: int,
    num_layers: int,
    num_heads: int,
    ffn_dim: int,
    tie_embeddings: bool,
    published_params: float,
    **overrides,
) -> ModelConfig:
    """A Qwen3-style decoder (vocab 151936, 8 kv heads of 128, QK-norm)."""
    fields = dict(
        vocab_size=151936,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn_dim,
        max_seq_len=40960,
        norm_type="rmsnorm",
        norm_eps=1e-6,
        position_embedding="rope",
        rope_theta=1_000_000.0,
        qk_norm=True,
        activation="swiglu",
        tie_embeddings=tie_embeddings,
        extra={"family": "qwen3", "hf_family": "qwen3", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# name: (d_model, layers, heads, ffn, tied, published) — published as on the model cards.
_TABLE = {
    "qwen3-0.6b": (1024, 28, 16, 3072, True, 0.6e9),
    "qwen3-1.7b": (2048, 28, 16, 6144, True, 1.7e9),
    "qwen3-4b": (2560, 36, 32, 9728, True, 4.0e9),
    "qwen3-8b": (4096, 36, 32, 12288, False, 8.2e9),
    "qwen3-14b": (5120, 40, 40, 17408, False, 14.8e9),
    "qwen3-32b": (5120, 64, 64, 25600, False, 32.8e9),
}


PRESETS = presets_from_table(
    _TABLE, qwen3_config, (
        "dim", "num_layers", "num_heads", "ffn_dim", "tie_embeddings", "published_params"
    )
)
