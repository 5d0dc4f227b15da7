"""Gopher family (Rae et al. 2021, Table 1) and Chinchilla (Hoffmann et al. 2022, Table 4).

Pre-RMSNorm decoders with ffn 4 * d_model, a 32000-token SentencePiece vocabulary, tied
embeddings, a 2048-token context and, in place of absolute positions, the relative position
encoding of Transformer-XL (Dai et al. 2019; Rae et al. 2021 §3, "Models"), which is
``position_embedding="relative_xl"`` (``models/relative.py``). Its per-layer position
projection W_R (d_model x d_model) and biases u, v (2 d_model) are part of the published
counts: with them every preset rounds to its published size
(tests/unit/models/test_relative_positions.py).
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig
from densetrain.models.presets._table import presets_from_table


def gopher_config(
    *, num_layers: int, num_heads: int, head_dim: int, dim: int, published_params: float,
    family: str = "gopher",
) -> ModelConfig:
    """A Gopher-style decoder at one row of Gopher Table 1 / Chinchilla Table 4."""
    return ModelConfig(
        vocab_size=32000,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        max_seq_len=2048,
        norm_type="rmsnorm",
        position_embedding="relative_xl",
        activation="gelu",
        tie_embeddings=True,
        extra={"family": family, "published_params": published_params},
    )


# name: (layers, heads, key/value size, d_model, published) — Gopher Table 1.
_TABLE_1 = {
    "gopher-44m": (8, 16, 32, 512, 44e6),
    "gopher-117m": (12, 12, 64, 768, 117e6),
    "gopher-417m": (12, 12, 128, 1536, 417e6),
    "gopher-1.4b": (24, 16, 128, 2048, 1.4e9),
    "gopher-7.1b": (32, 32, 128, 4096, 7.1e9),
    "gopher-280b": (80, 128, 128, 16384, 280e9),
}


PRESETS = presets_from_table(
    _TABLE_1, gopher_config, ("num_layers", "num_heads", "head_dim", "dim", "published_params")
)
# Chinchilla Table 4: 80 layers, 64 heads, key/value size 128, d_model 8192.
PRESETS["chinchilla-70b"] = lambda: gopher_config(
    num_layers=80, num_heads=64, head_dim=128, dim=8192, published_params=70e9,
    family="chinchilla",
)
