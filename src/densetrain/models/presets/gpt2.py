"""GPT-2 (Radford et al. 2019, Table 2): 124M, 355M, 774M and 1.5B.

Sizes are those of the released checkpoints (``gpt2``, ``gpt2-medium``, ``gpt2-large``,
``gpt2-xl``); the paper's Table 2 quotes 117M/345M/762M/1542M, counted before the released
vocabulary and context were fixed. The counts here equal ``GPT2LMHeadModel``'s exactly.
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig


def gpt2_config(
    *, dim: int, num_layers: int, num_heads: int, published_params: float, **overrides
) -> ModelConfig:
    """A GPT-2-style decoder: pre-LayerNorm with biases, learned positions, GELU (tanh), tied."""
    fields = dict(
        vocab_size=50257,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        max_seq_len=1024,
        norm_type="layernorm",
        norm_eps=1e-5,
        norm_bias=True,
        position_embedding="learned",
        qkv_bias=True,
        attn_out_bias=True,
        activation="gelu_tanh",
        mlp_bias=True,
        tie_embeddings=True,
        extra={"family": "gpt2", "hf_family": "gpt2", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


PRESETS = {
    "gpt2-124m": lambda: gpt2_config(dim=768, num_layers=12, num_heads=12, published_params=124e6),
    "gpt2-355m": lambda: gpt2_config(dim=1024, num_layers=24, num_heads=16, published_params=355e6),
    "gpt2-774m": lambda: gpt2_config(dim=1280, num_layers=36, num_heads=20, published_params=774e6),
    "gpt2-1.5b": lambda: gpt2_config(dim=1600, num_layers=48, num_heads=25, published_params=1.5e9),
}
