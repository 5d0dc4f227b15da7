"""Hugging Face adapter of phi-1 / phi-1.5 / phi-2 (``PhiForCausalLM``).

One LayerNorm feeds a parallel attention + MLP block; partial rotary embeddings; biases on every
linear layer including the output projection.
"""

from __future__ import annotations

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import (
    STANDARD_HF_KEYS,
    HFAdapter,
    Pair,
    activation_from_hf,
    activation_to_hf,
    hf_bool,
    hf_float,
    hf_int,
    hf_str,
    layer_prefixes,
    layernorm_mha_fields,
    linear_pairs,
    norm_pairs,
    rope_from_hf,
    rope_to_hf,
)


class PhiAdapter(HFAdapter):
    """``PhiForCausalLM``."""

    model_type = "phi"
    architecture = "PhiForCausalLM"
    base_prefix = "model."
    ignored_patterns = (r"rotary_emb\.inv_freq$",)
    hf_keys = {**STANDARD_HF_KEYS, "norm_eps": "layer_norm_eps"}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of a phi ``config.json``."""
        if hf_bool(hf, "qk_layernorm", False):
            raise UserError("config.json qk_layernorm=true is not supported for phi")
        heads = hf_int(hf, "num_attention_heads")
        return ModelConfig(
            vocab_size=hf_int(hf, "vocab_size"),
            dim=hf_int(hf, "hidden_size"),
            num_layers=hf_int(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf_int(hf, "num_key_value_heads", None) or heads,
            ffn_dim=hf_int(hf, "intermediate_size"),
            max_seq_len=hf_int(hf, "max_position_embeddings", 2048),
            norm_type="layernorm",
            norm_eps=hf_float(hf, "layer_norm_eps", 1e-5),
            norm_bias=True,
            position_embedding="rope",
            qkv_bias=True,
            attn_out_bias=True,
            activation=activation_from_hf(hf_str(hf, "hidden_act", "gelu_new"), "hidden_act"),
            mlp_bias=True,
            block_type="parallel",
            parallel_shared_norm=True,
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", False),
            lm_head_bias=True,
            extra={"family": "phi", "hf_family": "phi"},
            **{"rotary_fraction": 0.5, **rope_from_hf(hf)},
        )

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """phi fixes the block, norms and biases."""
        return {
            **layernorm_mha_fields(cfg),
            "position_embedding": "rope",
            "rope_scaling": None,
            "qkv_bias": True,
            "attn_out_bias": True,
            "mlp_bias": True,
            "block_type": "parallel",
            "parallel_shared_norm": True,
            "embedding_norm": False,
            "final_norm": True,
            "embed_dim": cfg.dim,
            "tie_embeddings": False,
            "lm_head_bias": True,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """phi ``config.json`` dict."""
        self.check_expressible(cfg)
        return {
            **self.base_hf_config(cfg),
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.ffn_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "layer_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg, self.model_type),
            "partial_rotary_factor": cfg.rotary_fraction,
            "qk_layernorm": False,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attention_dropout": cfg.dropout,
            **rope_to_hf(cfg, with_fraction=True),
        }

    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """All phi tensors are plain renames."""
        pairs = [Pair("tok_embeddings.weight", "model.embed_tokens.weight")]
        for dt, hf in layer_prefixes(cfg, "model.layers."):
            pairs += norm_pairs(dt + "attn_norm", hf + "input_layernorm", cfg)
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"),
                                 ("wo", "dense")):
                pairs += linear_pairs(dt + "attn." + ours, hf + "self_attn." + theirs, True)
            pairs += linear_pairs(dt + "mlp.w_up", hf + "mlp.fc1", True)
            pairs += linear_pairs(dt + "mlp.w_down", hf + "mlp.fc2", True)
        pairs += norm_pairs("norm", "model.final_layernorm", cfg)
        pairs += linear_pairs("output", "lm_head", True)
        return pairs
