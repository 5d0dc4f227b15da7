"""BLOOM (BigScience 2022, Table 3): 560M, 1.1B, 1.7B, 3B, 7.1B and 176B.

ALiBi instead of position embeddings, a LayerNorm right after the token embedding, GELU (tanh),
biases everywhere, tied embeddings, vocabulary 250880. Counts equal ``BloomForCausalLM``'s
exactly. ALiBi sets no length limit; ``max_seq_len`` is the training length, 2048.
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig
from densetrain.models.presets._table import presets_from_table


def bloom_config(
    *, dim: int, num_layers: int, num_heads: int, published_params: float, **overrides
) -> ModelConfig:
    """A BLOOM-style decoder."""
    fields = dict(
        vocab_size=250880,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        max_seq_len=2048,
        norm_type="layernorm",
        norm_eps=1e-5,
        norm_bias=True,
        embedding_norm=True,
        position_embedding="alibi",
        qkv_bias=True,
        attn_out_bias=True,
        activation="gelu_tanh",
        mlp_bias=True,
        tie_embeddings=True,
        extra={"family": "bloom", "hf_family": "bloom", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# name: (d_model, layers, heads, published) — Table 3.
_TABLE_3 = {
    "bloom-560m": (1024, 24, 16, 560e6),
    "bloom-1.1b": (1536, 24, 16, 1.1e9),
    "bloom-1.7b": (2048, 24, 16, 1.7e9),
    "bloom-3b": (2560, 30, 32, 3e9),
    "bloom-7.1b": (4096, 30, 32, 7.1e9),
    "bloom-176b": (14336, 70, 112, 176e9),
}


PRESETS = presets_from_table(
    _TABLE_3, bloom_config, ("dim", "num_layers", "num_heads", "published_params")
)
