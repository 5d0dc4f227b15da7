"""densetrain.generate: KV cache (with a sliding-window rolling buffer) and sampling."""

from densetrain.generate.kv_cache import KVCache, LayerKVCache
from densetrain.generate.sampling import filter_logits, generate, sample_next

__all__ = ["KVCache", "LayerKVCache", "filter_logits", "generate", "sample_next"]
