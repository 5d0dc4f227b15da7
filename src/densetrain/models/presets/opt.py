"""OPT (Zhang et al. 2022, Table 1): 125M to 175B.

Pre-LayerNorm (post-LayerNorm and no final norm for 350M), ReLU, learned positions whose table
starts 2 rows in, tied embeddings, vocabulary 50272. OPT-350M embeds tokens at width 512 and
projects to 1024 and back. Counts equal ``OPTForCausalLM``'s exactly.
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig
from densetrain.models.presets._table import presets_from_table


def opt_config(
    *, dim: int, num_layers: int, num_heads: int, published_params: float, **overrides
) -> ModelConfig:
    """An OPT-style decoder (context 2048, ffn 4 * dim, biases everywhere)."""
    fields = dict(
        vocab_size=50272,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        max_seq_len=2048,
        norm_type="layernorm",
        norm_eps=1e-5,
        norm_bias=True,
        position_embedding="learned",
        learned_pos_offset=2,
        qkv_bias=True,
        attn_out_bias=True,
        activation="relu",
        mlp_bias=True,
        tie_embeddings=True,
        extra={"family": "opt", "hf_family": "opt", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# name: (d_model, layers, heads, published) — Table 1.
_TABLE_1 = {
    "opt-125m": (768, 12, 12, 125e6),
    "opt-1.3b": (2048, 24, 32, 1.3e9),
    "opt-2.7b": (2560, 32, 32, 2.7e9),
    "opt-6.7b": (4096, 32, 32, 6.7e9),
    "opt-13b": (5120, 40, 40, 13e9),
    "opt-30b": (7168, 48, 56, 30e9),
    "opt-66b": (9216, 64, 72, 66e9),
    "opt-175b": (12288, 96, 96, 175e9),
}


PRESETS = presets_from_table(
    _TABLE_1, opt_config, ("dim", "num_layers", "num_heads", "published_params")
)
PRESETS["opt-350m"] = lambda: opt_config(
    dim=1024,
    num_layers=24,
    num_heads=16,
    published_params=350e6,
    embed_dim=512,
    norm_position="post",
    final_norm=False,
)
