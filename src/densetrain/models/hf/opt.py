"""Hugging Face adapter of OPT (``OPTForCausalLM``).

OPT's learned position table has ``max_position_embeddings + 2`` rows and position p reads row
p + 2 (``learned_pos_offset=2``). OPT-350m embeds tokens at ``word_embed_proj_dim`` and
projects in and out (``project_in``/``project_out``), and normalises after each residual add
(``do_layer_norm_before=false``) with no final norm.
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
    hf_int,
    hf_str,
    layer_prefixes,
    layernorm_mha_fields,
    linear_pairs,
    norm_pairs,
)

OPT_POSITION_OFFSET = 2


class OPTAdapter(HFAdapter):
    """``OPTForCausalLM``."""

    model_type = "opt"
    architecture = "OPTForCausalLM"
    base_prefix = "model.decoder."
    hf_keys = {**STANDARD_HF_KEYS, "ffn_dim": "ffn_dim", "embed_dim": "word_embed_proj_dim",
               "norm_position": "do_layer_norm_before"}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of an OPT ``config.json``."""
        if not hf_bool(hf, "layer_norm_elementwise_affine", True):
            raise UserError("config.json layer_norm_elementwise_affine=false is not supported")
        pre_norm = hf_bool(hf, "do_layer_norm_before", True)
        bias = hf_bool(hf, "enable_bias", True)
        dim = hf_int(hf, "hidden_size")
        return ModelConfig(
            vocab_size=hf_int(hf, "vocab_size"),
            dim=dim,
            num_layers=hf_int(hf, "num_hidden_layers"),
            num_heads=hf_int(hf, "num_attention_heads"),
            ffn_dim=hf_int(hf, "ffn_dim"),
            max_seq_len=hf_int(hf, "max_position_embeddings", 2048),
            embed_dim=hf_int(hf, "word_embed_proj_dim", None) or dim,
            norm_type="layernorm",
            norm_eps=1e-5,
            norm_bias=True,
            norm_position="pre" if pre_norm else "post",
            final_norm=pre_norm and not hf_bool(hf, "_remove_final_layer_norm", False),
            position_embedding="learned",
            learned_pos_offset=OPT_POSITION_OFFSET,
            qkv_bias=bias,
            attn_out_bias=bias,
            activation=activation_from_hf(
                hf_str(hf, "activation_function", "relu"), "activation_function"
            ),
            mlp_bias=bias,
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", True),
            extra={"family": "opt", "hf_family": "opt"},
        )

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """OPT fixes norms, positions, one bias switch and multi-head attention."""
        return {
            **layernorm_mha_fields(cfg),
            "norm_eps": 1e-5,
            "position_embedding": "learned",
            "learned_pos_offset": OPT_POSITION_OFFSET,
            "num_kv_heads": cfg.num_heads,
            "attn_out_bias": cfg.qkv_bias,
            "mlp_bias": cfg.qkv_bias,
            "block_type": "sequential",
            "embedding_norm": False,
            "lm_head_bias": False,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """OPT ``config.json`` dict."""
        self.check_expressible(cfg)
        pre_norm = cfg.norm_position == "pre"
        return {
            **self.base_hf_config(cfg),
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "ffn_dim": cfg.ffn_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "word_embed_proj_dim": cfg.embed_dim,
            "do_layer_norm_before": pre_norm,
            "_remove_final_layer_norm": pre_norm and not cfg.final_norm,
            "activation_function": activation_to_hf(cfg, self.model_type),
            "enable_bias": cfg.qkv_bias,
            "layer_norm_elementwise_affine": True,
            "dropout": cfg.dropout,
            "attention_dropout": cfg.dropout,
        }

    def check_expressible(self, cfg: ModelConfig) -> None:
        """Also refuses post-norm with a final norm (OPT post-norm models have none)."""
        super().check_expressible(cfg)
        if cfg.norm_position == "post" and cfg.final_norm:
            raise UserError(
                "cannot export this model as Hugging Face 'opt': norm_position='post' with "
                "final_norm=True (OPT post-norm models have no final norm)"
            )

    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """All OPT tensors are plain renames."""
        top = "model.decoder."
        pairs = [
            Pair("tok_embeddings.weight", top + "embed_tokens.weight"),
            Pair("pos_embeddings.weight", top + "embed_positions.weight"),
        ]
        if cfg.embed_dim != cfg.dim:
            pairs.append(Pair("project_in.weight", top + "project_in.weight"))
            pairs.append(Pair("project_out.weight", top + "project_out.weight"))
        bias = cfg.qkv_bias
        for dt, hf in layer_prefixes(cfg, top + "layers."):
            pairs += norm_pairs(dt + "attn_norm", hf + "self_attn_layer_norm", cfg)
            pairs += norm_pairs(dt + "mlp_norm", hf + "final_layer_norm", cfg)
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"),
                                 ("wo", "out_proj")):
                pairs += linear_pairs(dt + "attn." + ours, hf + "self_attn." + theirs, bias)
            pairs += linear_pairs(dt + "mlp.w_up", hf + "fc1", bias)
            pairs += linear_pairs(dt + "mlp.w_down", hf + "fc2", bias)
        if cfg.final_norm:
            pairs += norm_pairs("norm", top + "final_layer_norm", cfg)
        if not cfg.tie_embeddings:
            pairs.append(Pair("output.weight", "lm_head.weight"))
        return pairs
