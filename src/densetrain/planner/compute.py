"""FLOPs per step: model FLOPs (for MFU), hardware FLOPs (with recompute), and MFU itself.

Model FLOPs per token are PaLM's 6N + 12·L·H·Q·T (Chowdhery et al. 2022, appendix B), taken from
``densetrain.models.sizing`` (the single source of counts). Recompute adds the re-run forward:
for selective recompute (without FlashAttention) the attention core, 2·2·T·(H·Q) per layer and
token (QK^T and AV); for full recompute the whole block forward, 2·N_non-embedding + that term.
"""

from __future__ import annotations

import importlib

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.planner.layout import AC_POLICIES
from densetrain.planner.params import sharded_params

_SELECTIVE, _FULL = AC_POLICIES.index("selective"), AC_POLICIES.index("full")


def sizing_module():
    """``densetrain.models.sizing``, or a ``RuntimeError`` saying it is missing."""
    try:
        return importlib.import_module("densetrain.models.sizing")
    except ModuleNotFoundError as e:  # pragma: no cover - only before models/sizing.py exists
        raise RuntimeError(
            "densetrain.models.sizing is not available; the planner takes parameter and FLOP "
            "counts from it"
        ) from e


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """PaLM model FLOPs per token (forward + backward), from ``models.sizing``."""
    return float(sizing_module().flops_per_token_palm(cfg, seq_len))


def attention_core_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of QK^T and AV per token over all layers: 2·2·L·T·(H·Q)."""
    return 4.0 * cfg.num_layers * seq_len * cfg.q_dim


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, policy, flash_attention: bool):
    """Extra forward FLOPs per token spent recomputing, per activation-checkpointing policy."""
    policy = np.asarray(policy)
    core = attention_core_flops_per_token(cfg, seq_len)
    non_embedding = float(sizing_module().param_counts(cfg).non_embedding)
    selective = 0.0 if flash_attention else core
    return np.select([policy == _SELECTIVE, policy == _FULL],
                     [selective, 2.0 * non_embedding + core], default=0.0)


def stage_imbalance(cfg: ModelConfig, seq_len: int, pp):
    """Work of the busiest pipeline stage over the mean stage work (1 without a pipeline).

    A stage's work is 6·(its layer parameters) + 12·T·H·Q per layer and token; the last stage
    also runs the output projection, 6·V·d. Stages get ceil(L/pp) layers at most.
    """
    pp = np.asarray(pp, dtype=np.float64)
    per_layer = 6.0 * sharded_params(cfg, 1).per_layer + 12.0 * seq_len * cfg.q_dim
    head = 6.0 * cfg.padded_vocab_size * cfg.embed_dim
    busiest = np.ceil(cfg.num_layers / pp) * per_layer + head
    mean = (cfg.num_layers * per_layer + head) / pp
    return np.where(pp == 1, 1.0, busiest / mean)


def mfu(tokens_per_s: float, flops_per_token: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak."""
    if devices < 1 or peak_flops <= 0:
        raise ValueError(f"devices must be >= 1 and peak_flops > 0, got {devices}, {peak_flops}")
    return tokens_per_s * flops_per_token / (devices * peak_flops)
