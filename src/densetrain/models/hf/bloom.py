"""Hugging Face adapter of BLOOM (``BloomForCausalLM``).

ALiBi (no position weights), a LayerNorm on the embeddings (``word_embeddings_layernorm``) and a
per-head interleaved fused ``query_key_value`` as GPT-NeoX's.
"""

from __future__ import annotations

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import (
    HFAdapter,
    Pair,
    Tensors,
    hf_bool,
    hf_float,
    hf_int,
    layer_prefixes,
    layernorm_mha_fields,
    linear_pairs,
    norm_pairs,
)
from densetrain.models.hf.neox import export_fused_qkv, import_fused_qkv


class BloomAdapter(HFAdapter):
    """``BloomForCausalLM``."""

    model_type = "bloom"
    architecture = "BloomForCausalLM"
    base_prefix = "transformer."
    hf_keys = {"dim": "hidden_size", "num_layers": "n_layer", "num_heads": "n_head",
               "max_seq_len": "seq_length", "norm_eps": "layer_norm_epsilon",
               "tie_embeddings": "tie_word_embeddings"}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of a BLOOM ``config.json``."""
        if hf_bool(hf, "apply_residual_connection_post_layernorm", False):
            raise UserError(
                "config.json apply_residual_connection_post_layernorm=true is not supported"
            )
        dim = hf_int(hf, ("hidden_size", "n_embed"))
        return ModelConfig(
            vocab_size=hf_int(hf, "vocab_size"),
            dim=dim,
            num_layers=hf_int(hf, ("n_layer", "num_hidden_layers")),
            num_heads=hf_int(hf, ("n_head", "num_attention_heads")),
            ffn_dim=4 * dim,
            max_seq_len=hf_int(hf, "seq_length", 2048),
            norm_type="layernorm",
            norm_eps=hf_float(hf, "layer_norm_epsilon", 1e-5),
            norm_bias=True,
            embedding_norm=True,
            position_embedding="alibi",
            qkv_bias=True,
            attn_out_bias=True,
            activation="gelu_tanh",
            mlp_bias=True,
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", True),
            extra={"family": "bloom", "hf_family": "bloom"},
        )

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """BLOOM fixes everything but the sizes and tying."""
        return {
            **layernorm_mha_fields(cfg),
            "embedding_norm": True,
            "position_embedding": "alibi",
            "num_kv_heads": cfg.num_heads,
            "ffn_dim": 4 * cfg.dim,
            "qkv_bias": True,
            "attn_out_bias": True,
            "mlp_bias": True,
            "activation": "gelu_tanh",
            "block_type": "sequential",
            "norm_position": "pre",
            "final_norm": True,
            "embed_dim": cfg.dim,
            "lm_head_bias": False,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """BLOOM ``config.json`` dict."""
        self.check_expressible(cfg)
        return {
            **self.base_hf_config(cfg),
            "hidden_size": cfg.dim,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "layer_norm_epsilon": cfg.norm_eps,
            "seq_length": cfg.max_seq_len,
            "apply_residual_connection_post_layernorm": False,
            "hidden_dropout": cfg.dropout,
            "attention_dropout": cfg.dropout,
        }

    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """Everything but the fused query_key_value."""
        pairs = [Pair("tok_embeddings.weight", "transformer.word_embeddings.weight")]
        pairs += norm_pairs("embed_norm", "transformer.word_embeddings_layernorm", cfg)
        for dt, hf in layer_prefixes(cfg, "transformer.h."):
            pairs += norm_pairs(dt + "attn_norm", hf + "input_layernorm", cfg)
            pairs += norm_pairs(dt + "mlp_norm", hf + "post_attention_layernorm", cfg)
            pairs += linear_pairs(dt + "attn.wo", hf + "self_attention.dense", True)
            pairs += linear_pairs(dt + "mlp.w_up", hf + "mlp.dense_h_to_4h", True)
            pairs += linear_pairs(dt + "mlp.w_down", hf + "mlp.dense_4h_to_h", True)
        pairs += norm_pairs("norm", "transformer.ln_f", cfg)
        if not cfg.tie_embeddings:
            pairs.append(Pair("output.weight", "lm_head.weight"))
        return pairs

    def _export_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        export_fused_qkv(state, cfg, out, "transformer.h.", "self_attention.query_key_value")

    def _import_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        import_fused_qkv(state, cfg, out, "transformer.h.", "self_attention.query_key_value")
