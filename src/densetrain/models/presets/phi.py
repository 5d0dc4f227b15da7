"""phi-1 (Gunasekar et al. 2023, §2): a 1.3B decoder for code.

Parallel attention + MLP sharing one LayerNorm, rotary embeddings on half of each head's 64
dims, GELU (tanh), biases everywhere including the output projection, untied embeddings,
vocabulary 51200 (``microsoft/phi-1``'s config). The count equals ``PhiForCausalLM``'s exactly:
1.418B, which the paper calls "1.3B".
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig


def phi_config(
    *, dim: int, num_layers: int, num_heads: int, published_params: float, **overrides
) -> ModelConfig:
    """A phi-1-style decoder."""
    fields = dict(
        vocab_size=51200,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_dim=4 * dim,
        max_seq_len=2048,
        norm_type="layernorm",
        norm_eps=1e-5,
        norm_bias=True,
        position_embedding="rope",
        rotary_fraction=0.5,
        qkv_bias=True,
        attn_out_bias=True,
        activation="gelu_tanh",
        mlp_bias=True,
        block_type="parallel",
        parallel_shared_norm=True,
        tie_embeddings=False,
        lm_head_bias=True,
        extra={"family": "phi", "hf_family": "phi", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


PRESETS = {
    "phi-1": lambda: phi_config(dim=2048, num_layers=24, num_heads=32, published_params=1.3e9),
}
