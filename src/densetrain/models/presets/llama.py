"""LLaMA 1 (Touvron et al. 2023a, Table 2), Llama 2 (2023b, Table 1), Llama 3 and 3.1
(Dubey et al. 2024, Table 3).

Shapes and vocabularies are those of the released checkpoints' ``config.json``; the counts equal
``LlamaForCausalLM``'s exactly. ``published_params`` is the size in the model's name as the
paper gives it (LLaMA 1's Table 2 quotes 6.7B, 13.0B, 32.5B and 65.2B).
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig, RopeScaling


def llama_config(
    *,
    family: str,
    dim: int,
    num_layers: int,
    num_heads: int,
    ffn_dim: int,
    published_params: float,
    **overrides,
) -> ModelConfig:
    """A LLaMA-style decoder: pre-RMSNorm, RoPE, SwiGLU, no biases, untied embeddings."""
    fields = dict(
        vocab_size=32000,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_dim=ffn_dim,
        max_seq_len=2048,
        norm_type="rmsnorm",
        norm_eps=1e-6,
        position_embedding="rope",
        rope_theta=10000.0,
        activation="swiglu",
        tie_embeddings=False,
        extra={"family": family, "hf_family": "llama", "published_params": published_params},
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def _llama1(dim: int, layers: int, heads: int, ffn: int, published: float) -> ModelConfig:
    return llama_config(
        family="llama", dim=dim, num_layers=layers, num_heads=heads, ffn_dim=ffn,
        published_params=published,
    )


def _llama2(dim: int, layers: int, heads: int, kv: int, ffn: int, published: float) -> ModelConfig:
    return llama_config(
        family="llama2", dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        ffn_dim=ffn, published_params=published, max_seq_len=4096, norm_eps=1e-5,
    )


def _llama3(
    dim: int, layers: int, heads: int, ffn: int, published: float, *, scaled: bool
) -> ModelConfig:
    """Llama 3 (8K context) or, with ``scaled``, Llama 3.1 (128K context via RoPE scaling)."""
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192
    )
    return llama_config(
        family="llama3.1" if scaled else "llama3",
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        ffn_dim=ffn,
        published_params=published,
        vocab_size=128256,
        max_seq_len=131072 if scaled else 8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=scaling if scaled else None,
    )


PRESETS = {
    "llama-7b": lambda: _llama1(4096, 32, 32, 11008, 6.7e9),
    "llama-13b": lambda: _llama1(5120, 40, 40, 13824, 13.0e9),
    "llama-33b": lambda: _llama1(6656, 60, 52, 17920, 32.5e9),
    "llama-65b": lambda: _llama1(8192, 80, 64, 22016, 65.2e9),
    "llama2-7b": lambda: _llama2(4096, 32, 32, 32, 11008, 7e9),
    "llama2-13b": lambda: _llama2(5120, 40, 40, 40, 13824, 13e9),
    "llama2-70b": lambda: _llama2(8192, 80, 64, 8, 28672, 70e9),
    "llama3-8b": lambda: _llama3(4096, 32, 32, 14336, 8e9, scaled=False),
    "llama3-70b": lambda: _llama3(8192, 80, 64, 28672, 70e9, scaled=False),
    "llama3-405b": lambda: _llama3(16384, 126, 128, 53248, 405e9, scaled=False),
    "llama3.1-8b": lambda: _llama3(4096, 32, 32, 14336, 8e9, scaled=True),
    "llama3.1-70b": lambda: _llama3(8192, 80, 64, 28672, 70e9, scaled=True),
    "llama3.1-405b": lambda: _llama3(16384, 126, 128, 53248, 405e9, scaled=True),
}
