"""Mistral 7B (Jiang et al. 2023, Table 1): GQA with 8 kv heads and a 4096-token sliding window.

Shapes are those of ``mistralai/Mistral-7B-v0.1``'s config (context 32768, RoPE theta 1e4);
the count equals ``MistralForCausalLM``'s exactly (7.24B; the paper calls it 7.3B).
"""

from __future__ import annotations

from densetrain.models.presets.llama import llama_config

PRESETS = {
    "mistral-7b": lambda: llama_config(
        family="mistral",
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=14336,
        published_params=7.3e9,
        max_seq_len=32768,
        norm_eps=1e-5,
        sliding_window=4096,
        extra={"family": "mistral", "hf_family": "mistral", "published_params": 7.3e9},
    ),
}
