"""FLOPs per step: model FLOPs (for MFU), hardware FLOPs (with recompute), and MFU itself.

Model FLOPs per token are PaLM's 6N + 12·L·H·Q·T (Chowdhery et al. 2022, appendix B), taken from
``densetrain.models.sizing`` (the single source of counts). Recompute adds the re-run forward:
for selective recompute (without FlashAttention) the attention core, 2·2·T·(H·Q) per layer and
token (QK^T and AV); for full recompute the whole block forward, 2·N_non-embedding + that term.

Transformer-XL relative positions (``relative_xl``): model FLOPs hold the position-score matmul
(18·L·H·Q·T in place of 12) and leave W_R out of N (``sizing.flops_per_token_palm``); full
recompute repeats the position scores' forward (2·L·T·H·Q per token) and W_R's projection once
per microbatch; selective recompute keeps them (matmul outputs). Hardware FLOPs
(``hardware_flops_per_token``) add W_R's projection and weight gradient once per microbatch,
which model FLOPs leave out.
"""

from __future__ import annotations

import importlib

import numpy as np

from densetrain.errors import UserError
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


def early_stop_skips_down(cfg: ModelConfig) -> bool:
    """Whether a non-reentrant checkpoint of a block stops before its last matmul: in a pre-norm
    sequential block without dropout nothing backward needs is computed after the MLP's down
    projection (its output only feeds the residual add)."""
    return (cfg.norm_position == "pre" and cfg.block_type == "sequential"
            and cfg.dropout == 0)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, policy, flash_attention: bool,
                              micro_batch=None, early_stop: bool = False):
    """Extra forward FLOPs per token spent recomputing, per activation-checkpointing policy.

    With ``early_stop`` (``PlanSettings.checkpoint_early_stop``), full recompute leaves out the
    down projection's 2·d·ffn per layer where ``early_stop_skips_down`` holds.

    For ``relative_xl``, full recompute also repeats W_R's projection, once per microbatch of
    ``micro_batch`` sequences (2·L·T·d·q / (micro_batch·T) per token); without ``micro_batch``
    that term is left out (it is below 2·d·q per layer and token, a d x q matrix's forward).
    """
    sizing = sizing_module()
    policy = np.asarray(policy)
    core = attention_core_flops_per_token(cfg, seq_len)
    position_params = cfg.num_layers * sizing.relative_position_params(cfg)
    block_matmuls = 2.0 * (sizing.param_counts(cfg).non_embedding - position_params)
    position = 0.0
    if cfg.position_embedding == "relative_xl":
        position = 2.0 * cfg.num_layers * seq_len * cfg.q_dim
        if micro_batch is not None:
            position = position + sizing.relative_projection_flops_per_token(
                cfg, seq_len, np.asarray(micro_batch, dtype=np.float64))
    if early_stop and early_stop_skips_down(cfg):
        block_matmuls -= 2.0 * cfg.num_layers * cfg.dim * cfg.ffn_dim
    selective = 0.0 if flash_attention else core
    return np.select([policy == _SELECTIVE, policy == _FULL],
                     [selective, block_matmuls + core + position], default=0.0)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, policy, flash_attention: bool,
                             micro_batch, early_stop: bool = False,
                             output_projection_recomputed=False) -> np.ndarray:
    """FLOPs per token a step executes: ``sizing.flops_per_token_executed`` (model FLOPs plus
    W_R's projection once per microbatch) plus the recomputed forward (elementwise over
    ``policy`` and ``micro_batch`` arrays). ``output_projection_recomputed`` (per row): the
    trainer's block policy recomputes each layer's attention output projection
    (`planner.ops.output_projection_recomputed`), 2·d·q per layer and token."""
    sizing = sizing_module()
    micro_batch = np.asarray(micro_batch, dtype=np.float64)
    projection = 2.0 * sizing.relative_projection_flops_per_token(cfg, seq_len, micro_batch)
    executed = sizing.flops_per_token_palm(cfg, seq_len) + projection
    wo = np.where(output_projection_recomputed, 2.0 * cfg.num_layers * cfg.dim * cfg.q_dim, 0.0)
    return executed + wo + recompute_flops_per_token(cfg, seq_len, policy, flash_attention,
                                                     micro_batch=micro_batch,
                                                     early_stop=early_stop)


def stage_imbalance(cfg: ModelConfig, seq_len: int, pp):
    """Work of the busiest pipeline stage over the mean stage work (1 without a pipeline).

    A stage's work is 6·(its layer parameters that meet tokens in matmuls) + the attention's
    12·T·H·Q (18 with relative positions) per layer and token; the last stage also runs the
    output projection, 6·V·d. Stages get ceil(L/pp) layers at most.
    """
    pp = np.asarray(pp, dtype=np.float64)
    layer_params = sharded_params(cfg, 1).per_layer - sizing_module().relative_position_params(cfg)
    attention = sizing_module().attention_flops_per_token(cfg, seq_len) / cfg.num_layers
    per_layer = 6.0 * layer_params + attention
    head = 6.0 * cfg.padded_vocab_size * cfg.embed_dim
    busiest = np.ceil(cfg.num_layers / pp) * per_layer + head
    mean = (cfg.num_layers * per_layer + head) / pp
    return np.where(pp == 1, 1.0, busiest / mean)


def mfu(tokens_per_s: float, flops_per_token: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak."""
    if devices < 1 or peak_flops <= 0:
        raise UserError(f"devices must be >= 1 and peak_flops > 0, got {devices}, {peak_flops}")
    return tokens_per_s * flops_per_token / (devices * peak_flops)
