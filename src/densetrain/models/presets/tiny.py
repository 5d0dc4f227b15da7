"""Tiny presets for CPU work and tests: a few layers, width 128, context 256.

``vocab_size`` is a placeholder (8192): callers set it from their tokenizer, e.g.
``get_preset("tiny-llama", vocab_size=tokenizer.vocab_size)``. ``tiny-llama`` is the default
training model.
"""

from __future__ import annotations

from densetrain.models.presets.bloom import bloom_config
from densetrain.models.presets.gpt2 import gpt2_config
from densetrain.models.presets.llama import llama_config
from densetrain.models.presets.neox import neox_config
from densetrain.models.presets.opt import opt_config
from densetrain.models.presets.qwen3 import qwen3_config

_TINY = dict(vocab_size=8192, max_seq_len=256)


def _tiny_extra(family: str, hf_family: str) -> dict:
    return {"family": family, "hf_family": hf_family, "tiny": True}


PRESETS = {
    "tiny-llama": lambda: llama_config(
        family="llama", dim=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=352,
        published_params=0, norm_eps=1e-5, extra=_tiny_extra("llama", "llama"), **_TINY,
    ),
    "tiny-mistral": lambda: llama_config(
        family="mistral", dim=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=352,
        published_params=0, norm_eps=1e-5, sliding_window=128,
        extra=_tiny_extra("mistral", "mistral"), **_TINY,
    ),
    "tiny-qwen3": lambda: qwen3_config(
        dim=128, num_layers=4, num_heads=4, ffn_dim=384, tie_embeddings=True,
        published_params=0, num_kv_heads=2, head_dim=64,
        extra=_tiny_extra("qwen3", "qwen3"), **_TINY,
    ),
    "tiny-gpt2": lambda: gpt2_config(
        dim=128, num_layers=4, num_heads=4, published_params=0,
        extra=_tiny_extra("gpt2", "gpt2"), **_TINY,
    ),
    "tiny-neox": lambda: neox_config(
        dim=128, num_layers=4, num_heads=4, published_params=0,
        extra=_tiny_extra("gpt_neox", "gpt_neox"), **_TINY,
    ),
    "tiny-opt": lambda: opt_config(
        dim=128, num_layers=4, num_heads=4, published_params=0,
        extra=_tiny_extra("opt", "opt"), **_TINY,
    ),
    "tiny-bloom": lambda: bloom_config(
        dim=128, num_layers=4, num_heads=4, published_params=0,
        extra=_tiny_extra("bloom", "bloom"), **_TINY,
    ),
}
