"""GPT-3 (Brown et al. 2020, Table 2.1): the eight sizes from Small (125M) to 175B.

Built as GPT-2-style decoders (pre-LayerNorm, learned positions, GELU, tied embeddings) with the
GPT-2 vocabulary (50257) and a 2048-token context, at Table 2.1's n_layers, d_model, n_heads and
d_head. GPT-3 alternated dense and locally banded sparse attention layers; that pattern changes
no parameter count and is not modelled. Two rows of Table 2.1 are not self-consistent and are
read as follows:

- GPT-3 XL lists 24 heads of d_head 128 with d_model 2048 (24 * 128 = 3072); 16 heads of 128 keep
  d_head and d_model and give the published 1.3B (24 heads of 128 would give 1.5B).
- GPT-3 13B lists d_model 5140 with 40 heads of 128 (= 5120); both are kept as listed (the
  attention width is 5120, the residual stream 5140), which gives the published 13B.
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig
from densetrain.models.presets._table import presets_from_table
from densetrain.models.presets.gpt2 import gpt2_config


def gpt3_config(
    *, num_layers: int, dim: int, num_heads: int, head_dim: int, published_params: float
) -> ModelConfig:
    """A Table 2.1 row as a GPT-2-style model (vocab 50257, context 2048)."""
    return gpt2_config(
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        published_params=published_params,
        head_dim=head_dim,
        max_seq_len=2048,
        extra={"family": "gpt3", "published_params": published_params},
    )


# name: (n_layers, d_model, n_heads, d_head, published parameters) — Table 2.1.
_TABLE_2_1 = {
    "gpt3-125m": (12, 768, 12, 64, 125e6),
    "gpt3-350m": (24, 1024, 16, 64, 350e6),
    "gpt3-760m": (24, 1536, 16, 96, 760e6),
    "gpt3-1.3b": (24, 2048, 16, 128, 1.3e9),  # Table 2.1 lists 24 heads; see the module docstring
    "gpt3-2.7b": (32, 2560, 32, 80, 2.7e9),
    "gpt3-6.7b": (32, 4096, 32, 128, 6.7e9),
    "gpt3-13b": (40, 5140, 40, 128, 13e9),
    "gpt3-175b": (96, 12288, 96, 128, 175e9),
}


PRESETS = presets_from_table(
    _TABLE_2_1, gpt3_config, ("num_layers", "dim", "num_heads", "head_dim", "published_params")
)
