"""Parameters held by one device under tensor and pipeline parallelism.

The counts follow the parameter table of ``models/transformer.py`` and the tensor-parallel plan of
``densetrain.parallel``: column-parallel ``wq/wk/wv/w_up/w_gate`` (weight and bias split by tp),
row-parallel ``wo/w_down`` (weight split by tp, bias replicated), norms replicated, token
embedding and output vocab-parallel (rows padded to a multiple of tp, then split). With grouped
query attention and ``num_kv_heads < tp`` the key/value projections are replicated.
At tp=1 the total equals ``densetrain.models.sizing.param_counts(cfg).total`` (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.parallel.layout_check import (
    balanced_split,
    degrees_layout,
    kv_split,
    rule_reasons,
)


@dataclass(frozen=True, kw_only=True)
class ShardedParams:
    """Parameter counts on one tensor-parallel rank."""

    per_layer: int
    """One transformer block."""
    first_stage_extra: int
    """Token (and learned position) embedding, embedding norm, input projection."""
    last_stage_extra: int
    """Final norm, output projection (a separate copy when tied and pp > 1), output bias."""
    tied_output: int
    """Output rows shared with the embedding when tied (held once when one stage has both)."""
    num_layers: int

    def stage_layers(self, pp: int) -> list[int]:
        """Layers on each of ``pp`` stages, as the trainer splits them
        (`layout_check.balanced_split`)."""
        return balanced_split(self.num_layers, pp)

    def stage_params(self, pp: int) -> list[int]:
        """Parameters held by one rank of each pipeline stage."""
        counts = [n * self.per_layer for n in self.stage_layers(pp)]
        counts[0] += self.first_stage_extra
        counts[-1] += self.last_stage_extra
        if pp == 1:
            counts[0] -= self.tied_output  # a tied output shares the embedding's storage
        return counts

    def max_stage_params(self, pp: int) -> int:
        """Parameters on the most loaded rank (the memory planner sizes for it)."""
        return max(self.stage_params(pp))

    def total(self) -> int:
        """All parameters of one tensor-parallel rank with no pipeline split."""
        return self.stage_params(1)[0]


_TP_RULES = ("tp_divides_heads", "tp_and_kv_heads", "tp_divides_ffn")


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` cannot split ``cfg``'s weights (the shape rules of
    ``parallel.layout_check``), or None when it can."""
    if tp < 1:
        return f"tp must be >= 1, got {tp}"
    reasons = rule_reasons(_TP_RULES, degrees_layout(cfg, tp=int(tp)), cfg)
    return reasons[0] if reasons else None


def _norm(cfg: ModelConfig, width: int) -> int:
    return width * (2 if cfg.norm_type == "layernorm" and cfg.norm_bias else 1)


def sharded_params(cfg: ModelConfig, tp: int) -> ShardedParams:
    """Parameter counts of one tensor-parallel rank (see the module docstring for the plan)."""
    problem = check_tensor_parallel(cfg, tp)
    if problem:
        raise UserError(problem)
    dim, kv_dim, q_dim, ffn = cfg.dim, cfg.kv_dim, cfg.q_dim, cfg.ffn_dim
    kv_ways = kv_split(cfg.num_kv_heads, tp)  # GQA with fewer kv heads than tp: replicated
    qkv_bias = 1 if cfg.qkv_bias else 0
    attn = (q_dim * dim + qkv_bias * q_dim) // tp
    attn += 2 * (kv_dim * dim + qkv_bias * kv_dim) // kv_ways
    attn += dim * q_dim // tp + (dim if cfg.attn_out_bias else 0)
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    if cfg.position_embedding == "relative_xl":  # W_R, u, v: split with the heads
        attn += (cfg.dim * cfg.q_dim + 2 * cfg.q_dim) // tp
    num_up = 2 if cfg.activation == "swiglu" else 1
    mlp_bias = 1 if cfg.mlp_bias else 0
    mlp = num_up * (ffn * dim + mlp_bias * ffn) // tp + dim * ffn // tp + mlp_bias * dim
    num_norms = 1 if cfg.parallel_shared_norm else 2
    per_layer = attn + mlp + num_norms * _norm(cfg, dim)

    vocab_rows = math.ceil(cfg.padded_vocab_size / tp)
    embedding = vocab_rows * cfg.embed_dim
    first = embedding
    if cfg.position_embedding == "learned":
        first += (cfg.max_seq_len + cfg.learned_pos_offset) * dim
    if cfg.embedding_norm:
        first += _norm(cfg, dim)
    projections = dim * cfg.embed_dim if cfg.embed_dim != dim else 0
    first += projections
    last = (_norm(cfg, dim) if cfg.final_norm else 0) + projections + embedding
    if cfg.lm_head_bias:
        last += vocab_rows
    return ShardedParams(
        per_layer=per_layer,
        first_stage_extra=first,
        last_stage_extra=last,
        tied_output=embedding if cfg.tie_embeddings else 0,
        num_layers=cfg.num_layers,
    )
