"""Parameter names and shapes of a densetrain ``Transformer``, from its ``ModelConfig`` alone.

This follows the parameter-name table of models/transformer.py; the Hugging Face adapters map
these names, so checkpoints can be validated (and converted on the meta device) without
building a model.
"""

from __future__ import annotations

import torch

from densetrain.models.config import ModelConfig


def dt_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Transformer(cfg)`` by name, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (cfg.padded_vocab_size, cfg.embed_dim)
    }
    if cfg.position_embedding == "learned":
        shapes["pos_embeddings.weight"] = (cfg.max_seq_len + cfg.learned_pos_offset, cfg.dim)
    if cfg.embedding_norm:
        shapes.update(_norm_shapes("embed_norm", cfg, cfg.dim))
    if cfg.embed_dim != cfg.dim:
        shapes["project_in.weight"] = (cfg.dim, cfg.embed_dim)
        shapes["project_out.weight"] = (cfg.embed_dim, cfg.dim)
    for i in range(cfg.num_layers):
        shapes.update(_layer_shapes(cfg, f"layers.{i}."))
    if cfg.final_norm:
        shapes.update(_norm_shapes("norm", cfg, cfg.dim))
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.padded_vocab_size, cfg.embed_dim)
    if cfg.lm_head_bias:
        shapes["output.bias"] = (cfg.padded_vocab_size,)
    return shapes


def shape_mismatches(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]
                     ) -> tuple[list[str], list[str], list[str]]:
    """The names ``expected`` lists that ``found`` lacks, those ``found`` has beyond it, and
    those both hold with different shapes; each in ``expected``'s (``found``'s) order."""
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    misshaped = [n for n in expected if n in found and tuple(found[n]) != tuple(expected[n])]
    return missing, unexpected, misshaped


def _norm_shapes(name: str, cfg: ModelConfig, width: int) -> dict[str, tuple[int, ...]]:
    shapes = {f"{name}.weight": (width,)}
    if cfg.norm_type == "layernorm" and cfg.norm_bias:
        shapes[f"{name}.bias"] = (width,)
    return shapes


def _linear(name: str, out_dim: int, in_dim: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {f"{name}.weight": (out_dim, in_dim)}
    if bias:
        shapes[f"{name}.bias"] = (out_dim,)
    return shapes


def _layer_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    shapes = _norm_shapes(prefix + "attn_norm", cfg, cfg.dim)
    attn = prefix + "attn."
    shapes.update(_linear(attn + "wq", cfg.q_dim, cfg.dim, cfg.qkv_bias))
    shapes.update(_linear(attn + "wk", cfg.kv_dim, cfg.dim, cfg.qkv_bias))
    shapes.update(_linear(attn + "wv", cfg.kv_dim, cfg.dim, cfg.qkv_bias))
    shapes.update(_linear(attn + "wo", cfg.dim, cfg.q_dim, cfg.attn_out_bias))
    if cfg.qk_norm:
        shapes[attn + "q_norm.weight"] = (cfg.head_dim,)
        shapes[attn + "k_norm.weight"] = (cfg.head_dim,)
    if cfg.position_embedding == "relative_xl":
        shapes[attn + "relative.pos_proj.weight"] = (cfg.q_dim, cfg.dim)
        shapes[attn + "relative.content_bias.bias"] = (cfg.q_dim,)
        shapes[attn + "relative.position_bias.bias"] = (cfg.q_dim,)
    if cfg.block_type == "sequential" or not cfg.parallel_shared_norm:
        shapes.update(_norm_shapes(prefix + "mlp_norm", cfg, cfg.dim))
    mlp = prefix + "mlp."
    shapes.update(_linear(mlp + "w_up", cfg.ffn_dim, cfg.dim, cfg.mlp_bias))
    if cfg.activation == "swiglu":
        shapes.update(_linear(mlp + "w_gate", cfg.ffn_dim, cfg.dim, cfg.mlp_bias))
    shapes.update(_linear(mlp + "w_down", cfg.dim, cfg.ffn_dim, cfg.mlp_bias))
    return shapes


def meta_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Meta-device tensors with ``dt_param_shapes(cfg)``: lets adapters map shapes for free."""
    return {
        name: torch.empty(shape, device="meta") for name, shape in dt_param_shapes(cfg).items()
    }
