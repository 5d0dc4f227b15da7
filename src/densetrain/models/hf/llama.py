"""Hugging Face adapters of the LLaMA-style families: ``llama``, ``mistral`` and ``qwen3``.

Plain renames: q/k/v/o projections, gate/up/down MLP, two RMSNorms per layer, Qwen3's q_norm and
k_norm. Hugging Face rotates query/key halves (``rotate_half``) and so does densetrain, so the
projection rows need no permutation.
"""

from __future__ import annotations

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import (
    STANDARD_HF_KEYS,
    HFAdapter,
    Pair,
    hf_bool,
    hf_float,
    hf_int,
    hf_str,
    layer_prefixes,
    linear_pairs,
    rope_from_hf,
    rope_to_hf,
)


class LlamaAdapter(HFAdapter):
    """``LlamaForCausalLM``: RMSNorm, RoPE (incl. Llama 3.1 scaling), SwiGLU, optional biases."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    base_prefix = "model."
    ignored_patterns = (r"rotary_emb\.inv_freq$",)
    hf_keys = {**STANDARD_HF_KEYS, "norm_eps": "rms_norm_eps"}
    tie_default = False

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of a LLaMA-family ``config.json``."""
        if hf_str(hf, "hidden_act", "silu") != "silu":
            raise UserError(
                f"config.json hidden_act={hf['hidden_act']!r} is not supported for "
                f"{self.model_type}; allowed: 'silu' (SwiGLU)"
            )
        dim = hf_int(hf, "hidden_size")
        heads = hf_int(hf, "num_attention_heads")
        attention_bias = hf_bool(hf, "attention_bias", False)
        return ModelConfig(
            vocab_size=hf_int(hf, "vocab_size"),
            dim=dim,
            num_layers=hf_int(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf_int(hf, "num_key_value_heads", None) or heads,
            head_dim=hf_int(hf, "head_dim", None) or dim // heads,
            ffn_dim=hf_int(hf, "intermediate_size"),
            max_seq_len=hf_int(hf, "max_position_embeddings", 2048),
            norm_type="rmsnorm",
            norm_eps=hf_float(hf, "rms_norm_eps", 1e-6),
            position_embedding="rope",
            qkv_bias=attention_bias,
            attn_out_bias=attention_bias,
            qk_norm=self.model_type == "qwen3",
            sliding_window=self._window_from_hf(hf),
            activation="swiglu",
            mlp_bias=hf_bool(hf, "mlp_bias", False),
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", self.tie_default),
            extra={"family": self.model_type, "hf_family": self.model_type},
            **rope_from_hf(hf),
        )

    def _window_from_hf(self, hf: dict) -> int | None:
        return None

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """Fields every LLaMA-family model fixes."""
        return {
            "norm_type": "rmsnorm",
            "position_embedding": "rope",
            "rotary_fraction": 1.0,
            "activation": "swiglu",
            "block_type": "sequential",
            "norm_position": "pre",
            "embedding_norm": False,
            "final_norm": True,
            "embed_dim": cfg.dim,
            "lm_head_bias": False,
            "attn_out_bias": cfg.qkv_bias,
            "qk_norm": self.model_type == "qwen3",
            "sliding_window": None,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """LLaMA-family ``config.json`` dict."""
        self.check_expressible(cfg)
        return {
            **self.base_hf_config(cfg),
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu",
            "attention_bias": cfg.qkv_bias,
            "mlp_bias": cfg.mlp_bias,
            **rope_to_hf(cfg),
            **self._extra_hf(cfg),
        }

    def _extra_hf(self, cfg: ModelConfig) -> dict:
        return {}

    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """All LLaMA-family tensors are plain renames."""
        pairs = [Pair("tok_embeddings.weight", "model.embed_tokens.weight")]
        attn_bias, mlp_bias = cfg.qkv_bias, cfg.mlp_bias
        for dt, hf in layer_prefixes(cfg, "model.layers."):
            pairs.append(Pair(dt + "attn_norm.weight", hf + "input_layernorm.weight"))
            pairs.append(Pair(dt + "mlp_norm.weight", hf + "post_attention_layernorm.weight"))
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
                pairs += linear_pairs(dt + "attn." + ours, hf + "self_attn." + theirs, attn_bias)
            pairs += linear_pairs(dt + "attn.wo", hf + "self_attn.o_proj", cfg.attn_out_bias)
            if cfg.qk_norm:
                pairs.append(Pair(dt + "attn.q_norm.weight", hf + "self_attn.q_norm.weight"))
                pairs.append(Pair(dt + "attn.k_norm.weight", hf + "self_attn.k_norm.weight"))
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                                 ("w_down", "down_proj")):
                pairs += linear_pairs(dt + "mlp." + ours, hf + "mlp." + theirs, mlp_bias)
        pairs.append(Pair("norm.weight", "model.norm.weight"))
        if not cfg.tie_embeddings:
            pairs.append(Pair("output.weight", "lm_head.weight"))
        return pairs


class MistralAdapter(LlamaAdapter):
    """``MistralForCausalLM``: LLaMA plus a sliding attention window; no biases."""

    model_type = "mistral"
    architecture = "MistralForCausalLM"

    def _window_from_hf(self, hf: dict) -> int | None:
        return hf_int(hf, "sliding_window", None)

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """Mistral: no attention or MLP biases; any sliding window."""
        fields = super().required_fields(cfg)
        fields.update(qkv_bias=False, mlp_bias=False, sliding_window=cfg.sliding_window)
        return fields

    def _extra_hf(self, cfg: ModelConfig) -> dict:
        return {"sliding_window": cfg.sliding_window}


class Qwen3Adapter(LlamaAdapter):
    """``Qwen3ForCausalLM``: LLaMA plus QK-RMSNorm over head_dim; optional sliding window."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"

    def _window_from_hf(self, hf: dict) -> int | None:
        if not hf_bool(hf, "use_sliding_window", False):
            return None
        layer_types = hf.get("layer_types") or []
        if not isinstance(layer_types, list):
            raise UserError(f"config.json layer_types must be a list of attention types, got "
                            f"{layer_types!r}")
        if any(t != "sliding_attention" for t in layer_types):
            raise UserError(
                "config.json layer_types mixes full and sliding attention; only one attention "
                "type for all layers is supported"
            )
        return hf_int(hf, "sliding_window", None)

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """Qwen3: no MLP biases; any sliding window (applied to every layer)."""
        fields = super().required_fields(cfg)
        fields.update(mlp_bias=False, sliding_window=cfg.sliding_window)
        return fields

    def _extra_hf(self, cfg: ModelConfig) -> dict:
        window = cfg.sliding_window
        layer_type = "sliding_attention" if window else "full_attention"
        return {
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "max_window_layers": 0 if window else cfg.num_layers,
            "layer_types": [layer_type] * cfg.num_layers,
        }
