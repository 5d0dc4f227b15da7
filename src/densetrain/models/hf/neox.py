"""Hugging Face adapter of GPT-NeoX (``GPTNeoXForCausalLM``).

Query, key and value live in one ``query_key_value`` of [3 * dim, dim] whose rows are grouped
per head: head 0's q, k, v rows, then head 1's, ... (``fuse_heads``). The block is parallel
with two LayerNorms when ``use_parallel_residual`` (the default), sequential otherwise.
"""

from __future__ import annotations

from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import (
    STANDARD_HF_KEYS,
    HFAdapter,
    Pair,
    Tensors,
    activation_from_hf,
    activation_to_hf,
    fuse_heads,
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
    split_heads,
)


class NeoXAdapter(HFAdapter):
    """``GPTNeoXForCausalLM``: partial rotary, per-head fused QKV, parallel residual."""

    model_type = "gpt_neox"
    architecture = "GPTNeoXForCausalLM"
    base_prefix = "gpt_neox."
    ignored_patterns = (
        r"attention\.bias$",
        r"attention\.masked_bias$",
        r"rotary_emb\.inv_freq$",
    )
    hf_keys = {**STANDARD_HF_KEYS, "norm_eps": "layer_norm_eps", "rotary_fraction": "rotary_pct",
               "block_type": "use_parallel_residual"}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of a GPT-NeoX ``config.json``."""
        parallel = hf_bool(hf, "use_parallel_residual", True)
        bias = hf_bool(hf, "attention_bias", True)
        rope = {"rotary_fraction": 0.25, **rope_from_hf(hf)}
        return ModelConfig(
            vocab_size=hf_int(hf, "vocab_size"),
            dim=hf_int(hf, "hidden_size"),
            num_layers=hf_int(hf, "num_hidden_layers"),
            num_heads=hf_int(hf, "num_attention_heads"),
            ffn_dim=hf_int(hf, "intermediate_size"),
            max_seq_len=hf_int(hf, "max_position_embeddings", 2048),
            norm_type="layernorm",
            norm_eps=hf_float(hf, "layer_norm_eps", 1e-5),
            norm_bias=True,
            position_embedding="rope",
            qkv_bias=bias,
            attn_out_bias=bias,
            activation=activation_from_hf(hf_str(hf, "hidden_act", "gelu"), "hidden_act"),
            mlp_bias=True,
            block_type="parallel" if parallel else "sequential",
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", False),
            extra={"family": "gpt_neox", "hf_family": "gpt_neox"},
            **rope,
        )

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """GPT-NeoX fixes norms, biases and multi-head attention at dim / num_heads."""
        return {
            **layernorm_mha_fields(cfg),
            "position_embedding": "rope",
            "rope_scaling": None,
            "num_kv_heads": cfg.num_heads,
            "attn_out_bias": cfg.qkv_bias,
            "mlp_bias": True,
            "parallel_shared_norm": False,
            "norm_position": "pre",
            "embedding_norm": False,
            "final_norm": True,
            "embed_dim": cfg.dim,
            "lm_head_bias": False,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """GPT-NeoX ``config.json`` dict."""
        self.check_expressible(cfg)
        return {
            **self.base_hf_config(cfg),
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.ffn_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "layer_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg, self.model_type),
            "use_parallel_residual": cfg.block_type == "parallel",
            "attention_bias": cfg.qkv_bias,
            "rotary_pct": cfg.rotary_fraction,
            "rotary_emb_base": cfg.rope_theta,
            **rope_to_hf(cfg, with_fraction=True),
        }

    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """Everything but the fused query_key_value."""
        pairs = [Pair("tok_embeddings.weight", "gpt_neox.embed_in.weight")]
        for dt, hf in layer_prefixes(cfg, "gpt_neox.layers."):
            pairs += norm_pairs(dt + "attn_norm", hf + "input_layernorm", cfg)
            pairs += norm_pairs(dt + "mlp_norm", hf + "post_attention_layernorm", cfg)
            pairs += linear_pairs(dt + "attn.wo", hf + "attention.dense", cfg.attn_out_bias)
            pairs += linear_pairs(dt + "mlp.w_up", hf + "mlp.dense_h_to_4h", True)
            pairs += linear_pairs(dt + "mlp.w_down", hf + "mlp.dense_4h_to_h", True)
        pairs += norm_pairs("norm", "gpt_neox.final_layer_norm", cfg)
        if not cfg.tie_embeddings:
            pairs.append(Pair("output.weight", "embed_out.weight"))
        return pairs

    def _export_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        export_fused_qkv(state, cfg, out, "gpt_neox.layers.", "attention.query_key_value")

    def _import_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        import_fused_qkv(state, cfg, out, "gpt_neox.layers.", "attention.query_key_value")


def export_fused_qkv(
    state: Tensors, cfg: ModelConfig, out: Tensors, hf_layer: str, fused_name: str
) -> None:
    """Fuse each layer's wq/wk/wv (and biases) into a per-head interleaved tensor."""
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for dt, hf in layer_prefixes(cfg, hf_layer):
        for kind in kinds:
            q, k, v = (state[f"{dt}attn.{w}.{kind}"] for w in ("wq", "wk", "wv"))
            out[f"{hf}{fused_name}.{kind}"] = fuse_heads(q, k, v, cfg.num_heads)


def import_fused_qkv(
    state: Tensors, cfg: ModelConfig, out: Tensors, hf_layer: str, fused_name: str
) -> None:
    """Split each layer's per-head interleaved fused QKV into wq/wk/wv (and biases)."""
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for dt, hf in layer_prefixes(cfg, hf_layer):
        for kind in kinds:
            parts = split_heads(state[f"{hf}{fused_name}.{kind}"], cfg.num_heads)
            for w, part in zip(("wq", "wk", "wv"), parts, strict=True):
                out[f"{dt}attn.{w}.{kind}"] = part
