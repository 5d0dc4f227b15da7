"""GPT-NeoX-20B (Black et al. 2022, Table 1): parallel attention + MLP with two LayerNorms,
rotary embeddings on a quarter of each head, GELU in its tanh form (``gelu_fast`` in the released
config.json), untied embeddings, vocabulary 50432.

The count equals ``GPTNeoXForCausalLM``'s exactly (20.55B).
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig


def neox_config(
    *, dim: int, num_layers: int, num_heads: int, published_params: float, **overrides
) -> ModelConfig:
    """A GPT-NeoX-style decoder: parallel block (two norms), partial rotary 0.25, biases."""
    fields = dict(
        vocab_size=50432,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        max_seq_len=2048,
        norm_type="layernorm",
        norm_eps=1e-5,
        norm_bias=True,
        position_embedding="rope",
        rotary_fraction=0.25,
        rope_theta=10000.0,
        qkv_bias=True,
        attn_out_bias=True,
        activation="gelu_tanh",
        mlp_bias=True,
        block_type="parallel",
        parallel_shared_norm=False,
        tie_embeddings=False,
        extra={"family": "gpt_neox", "hf_family": "gpt_neox", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


PRESETS = {
    "gpt-neox-20b": lambda: neox_config(
        dim=6144, num_layers=44, num_heads=64, published_params=20.55e9
    ),
}
