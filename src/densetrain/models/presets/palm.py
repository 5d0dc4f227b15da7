"""PaLM (Chowdhery et al. 2022, Table 1): 8B, 62B and 540B.

Parallel attention + MLP sharing one LayerNorm, multi-query attention (one kv head), head size
256 at every scale (540B's 48 heads attend at width 12288 inside an 18432-wide residual stream),
SwiGLU with ffn 4 * d_model, RoPE, no biases in dense layers or norms, shared input/output
embeddings, a 256k SentencePiece vocabulary and z-loss 1e-4. ``published_params`` is Table 1's
parameter column (8.63B, 62.50B, 540.35B).
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig


def palm_config(
    *, dim: int, num_layers: int, num_heads: int, published_params: float, **overrides
) -> ModelConfig:
    """A PaLM-style decoder (vocab 256000, context 2048)."""
    fields = dict(
        vocab_size=256000,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=256,
        ffn_dim=4 * dim,
        max_seq_len=2048,
        norm_type="layernorm",
        norm_bias=False,
        position_embedding="rope",
        activation="swiglu",
        block_type="parallel",
        parallel_shared_norm=True,
        tie_embeddings=True,
        z_loss_coef=1e-4,
        extra={"family": "palm", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


PRESETS = {
    "palm-8b": lambda: palm_config(dim=4096, num_layers=32, num_heads=16, published_params=8.63e9),
    "palm-62b": lambda: palm_config(
        dim=8192, num_layers=64, num_heads=32, published_params=62.50e9
    ),
    "palm-540b": lambda: palm_config(
        dim=18432, num_layers=118, num_heads=48, published_params=540.35e9
    ),
}
