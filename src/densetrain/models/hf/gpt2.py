"""Hugging Face adapter of GPT-2 (``GPT2LMHeadModel``).

GPT-2 stores its linear layers as ``Conv1D`` modules whose weights are [in, out], the transpose
of ``nn.Linear``; query, key and value are fused into one ``c_attn`` of [dim, 3 * dim] whose
columns are q, then k, then v.
"""

from __future__ import annotations

import torch

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import (
    HFAdapter,
    Pair,
    Tensors,
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
)


class GPT2Adapter(HFAdapter):
    """``GPT2LMHeadModel``: learned positions, pre-LayerNorm, Conv1D layers, fused c_attn."""

    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    base_prefix = "transformer."
    ignored_patterns = (r"\.attn\.bias$", r"\.attn\.masked_bias$")
    hf_keys = {"dim": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
               "ffn_dim": "n_inner", "max_seq_len": "n_positions",
               "norm_eps": "layer_norm_epsilon", "tie_embeddings": "tie_word_embeddings"}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of a GPT-2 ``config.json``."""
        if hf_bool(hf, "scale_attn_by_inverse_layer_idx", False):
            raise UserError("config.json scale_attn_by_inverse_layer_idx=true is not supported")
        if not hf_bool(hf, "scale_attn_weights", True):
            raise UserError("config.json scale_attn_weights=false is not supported")
        dim = hf_int(hf, "n_embd")
        return ModelConfig(
            vocab_size=hf_int(hf, "vocab_size"),
            dim=dim,
            num_layers=hf_int(hf, "n_layer"),
            num_heads=hf_int(hf, "n_head"),
            ffn_dim=hf_int(hf, "n_inner", None) or 4 * dim,
            max_seq_len=hf_int(hf, "n_positions", 1024),
            norm_type="layernorm",
            norm_eps=hf_float(hf, "layer_norm_epsilon", 1e-5),
            norm_bias=True,
            position_embedding="learned",
            qkv_bias=True,
            attn_out_bias=True,
            activation=activation_from_hf(
                hf_str(hf, "activation_function", "gelu_new"), "activation_function"
            ),
            mlp_bias=True,
            tie_embeddings=hf_bool(hf, "tie_word_embeddings", True),
            extra={"family": "gpt2", "hf_family": "gpt2"},
        )

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """GPT-2 fixes everything but the sizes, activation and tying."""
        return {
            **layernorm_mha_fields(cfg),
            "position_embedding": "learned",
            "learned_pos_offset": 0,
            "num_kv_heads": cfg.num_heads,
            "qkv_bias": True,
            "attn_out_bias": True,
            "mlp_bias": True,
            "block_type": "sequential",
            "norm_position": "pre",
            "embedding_norm": False,
            "final_norm": True,
            "embed_dim": cfg.dim,
            "lm_head_bias": False,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """GPT-2 ``config.json`` dict."""
        self.check_expressible(cfg)
        return {
            **self.base_hf_config(cfg),
            "n_embd": cfg.dim,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_dim,
            "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": activation_to_hf(cfg, self.model_type),
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
        }

    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """Everything but the fused c_attn; Conv1D weights are transposed."""
        pairs = [
            Pair("tok_embeddings.weight", "transformer.wte.weight"),
            Pair("pos_embeddings.weight", "transformer.wpe.weight"),
        ]
        for dt, hf in layer_prefixes(cfg, "transformer.h."):
            pairs += norm_pairs(dt + "attn_norm", hf + "ln_1", cfg)
            pairs += norm_pairs(dt + "mlp_norm", hf + "ln_2", cfg)
            pairs += linear_pairs(dt + "attn.wo", hf + "attn.c_proj", True, transpose=True)
            pairs += linear_pairs(dt + "mlp.w_up", hf + "mlp.c_fc", True, transpose=True)
            pairs += linear_pairs(dt + "mlp.w_down", hf + "mlp.c_proj", True, transpose=True)
        pairs += norm_pairs("norm", "transformer.ln_f", cfg)
        if not cfg.tie_embeddings:
            pairs.append(Pair("output.weight", "lm_head.weight"))
        return pairs

    def _export_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        for dt, hf in layer_prefixes(cfg, "transformer.h."):
            for kind in ("weight", "bias"):
                q, k, v = (state[f"{dt}attn.{w}.{kind}"] for w in ("wq", "wk", "wv"))
                fused = torch.cat([q, k, v], dim=0)
                out[f"{hf}attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused

    def _import_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        for dt, hf in layer_prefixes(cfg, "transformer.h."):
            for kind in ("weight", "bias"):
                fused = state[f"{hf}attn.c_attn.{kind}"]
                fused = fused.t() if kind == "weight" else fused
                for w, part in zip(("wq", "wk", "wv"), fused.chunk(3, dim=0), strict=True):
                    out[f"{dt}attn.{w}.{kind}"] = part
