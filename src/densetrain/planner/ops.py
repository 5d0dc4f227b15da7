"""Compute time per device and step from per-operation costs (vectorised over layouts).

Per transformer layer and microbatch, on one device (t = micro_batch x seq / cp tokens):

- GEMMs by shape: qkv (t, d, (q + 2 kv) / tp), wo (t, q / tp, d), the MLP's up (and gate)
  (t, d, ffn / tp) and down (t, ffn / tp, d); the last stage adds the output head (t, d, V / tp).
  Backward runs each twice (input and weight gradients, same sizes). A GEMM of sides (m, n, k)
  takes the longer of 2mnk / (peak x eff) and its 2(mk + kn + mn) bytes over HBM, where
  eff = gemm_efficiency x s / (s + gemm_half_dim) for its smallest side s: large GEMMs run at
  the accelerator's measured maximum, small or skinny ones (tp-split, short microbatches) fall.
- Attention core: QK^T and AV, 4 t S (q / tp) FLOPs forward of which causal masking keeps half,
  backward 2.5x forward (FlashAttention recomputes the scores), at ``attention_efficiency``;
  without a fused kernel, as batched GEMMs plus the s x s softmax through HBM.
- Element-wise work is memory-bound: norms (read + write d, twice), residual adds (2 reads, 1
  write of d, twice), RoPE on q and k, the SwiGLU product (3 ffn) per token forward, twice that
  backward, bytes over HBM; sequence parallel splits the d-wide part over tp. The loss reads
  and writes fp32 logits three times (12 V / tp bytes per token).
- Recompute: full checkpointing repeats the forward of all of it; the trainer's selective
  policy keeps matmul and attention outputs and repeats the element-wise forward (without a
  fused kernel, also the attention core: Korthikanti et al. 2022's selective recompute).
- Transformer-XL relative positions (``relative_xl``, models/relative.py), counted with the
  attention: the position-score matmul, batched (s, T, K) GEMMs per head (backward 2x: the
  gradients of q + v and of the position keys); W_R's (T, q, d) GEMM once per microbatch
  (backward 1x: the weight gradient only); the relative shift's pad, the scale and the
  masked_fill, each a read and write of the s x T scores (backward: 8 such passes), and the
  q + u / q + v adds, over HBM. The float bias rules out the flash kernel: on CUDA SDPA takes
  the memory-efficient kernel, which reads the bias (and in backward reads it again and
  writes its gradient) and, the causal mask being inside the bias, computes every block of
  the s x T scores instead of half; without a fused kernel the math path adds the bias to the
  scores. The efficient kernel is assumed to run at ``attention_efficiency``, the flash
  kernel's figure. Selective recompute repeats the shift (its outputs are not matmuls).
"""

from __future__ import annotations

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.parallel.layout_check import kv_split
from densetrain.planner.compute import early_stop_skips_down
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import AC_POLICIES, LayoutColumns, PlanSettings

_SELECTIVE, _FULL = AC_POLICIES.index("selective"), AC_POLICIES.index("full")


def gemm_seconds(m, n, k, cluster: ClusterSpec, bytes_per_element: int = 2,
                 efficiency: float | None = None):
    """Time of one (m x k) @ (k x n) GEMM (elementwise over arrays)."""
    m, n, k = (np.asarray(x, dtype=np.float64) for x in (m, n, k))
    smallest = np.minimum(np.minimum(m, n), k)
    top = cluster.gemm_efficiency if efficiency is None else efficiency
    eff = top * smallest / (smallest + cluster.gemm_half_dim)
    flops_time = 2.0 * m * n * k / (cluster.peak_flops * eff)
    bytes_time = bytes_per_element * (m * k + k * n + m * n) / cluster.hbm_bytes_per_s
    return np.maximum(flops_time, bytes_time)


def _layer_gemms(cfg: ModelConfig, tokens, tp, cluster: ClusterSpec, eff):
    """(all of a layer's GEMMs, the MLP's down projection among them) forward seconds."""
    kv_local = cfg.kv_dim / kv_split(cfg.num_kv_heads, np.asarray(tp))
    num_up = 2 if cfg.activation == "swiglu" else 1
    qkv = gemm_seconds(tokens, cfg.q_dim / tp + 2 * kv_local, cfg.dim, cluster, efficiency=eff)
    wo = gemm_seconds(tokens, cfg.dim, cfg.q_dim / tp, cluster, efficiency=eff)
    up = num_up * gemm_seconds(tokens, cfg.ffn_dim / tp, cfg.dim, cluster, efficiency=eff)
    down = gemm_seconds(tokens, cfg.dim, cfg.ffn_dim / tp, cluster, efficiency=eff)
    return qkv + wo + up + down, down


def _attention_forward(cfg: ModelConfig, micro_batch, local_seq, seq_len, tp,
                       cluster: ClusterSpec, settings: PlanSettings, eff):
    heads_local = cfg.num_heads / tp
    # A fused kernel skips the masked half of a causal score matrix; relative_xl passes its
    # causal mask inside the float bias, so the kernel computes every block.
    causal_share = 1.0 if cfg.position_embedding == "relative_xl" else 0.5
    flops = 4.0 * micro_batch * local_seq * seq_len * cfg.q_dim / tp * causal_share
    if settings.flash_attention:
        return flops / (cluster.peak_flops * cluster.attention_efficiency)
    rows = micro_batch * heads_local
    scores = rows * gemm_seconds(local_seq, seq_len, cfg.head_dim, cluster, efficiency=eff)
    values = rows * gemm_seconds(local_seq, cfg.head_dim, seq_len, cluster, efficiency=eff)
    # softmax reads and writes the scores; dropout reads them and writes them and a mask.
    passes = 2 * 2 + ((2 * 2 + 1) if settings.attention_dropout else 0)
    softmax = rows * local_seq * seq_len * passes / cluster.hbm_bytes_per_s
    return scores + values + softmax


def _relative_position_seconds(cfg: ModelConfig, micro_batch, local_seq, seq_len, tp,
                               cluster: ClusterSpec, settings: PlanSettings, eff):
    """(forward, backward, element-wise forward) seconds of what Transformer-XL relative
    attention (models/relative.py) adds to a layer per microbatch; zeros for other models."""
    if cfg.position_embedding != "relative_xl":
        return 0.0, 0.0, 0.0
    e, hbm = settings.activation_bytes, cluster.hbm_bytes_per_s
    rows = micro_batch * cfg.num_heads / tp
    scores = rows * gemm_seconds(local_seq, seq_len, cfg.head_dim, cluster, efficiency=eff)
    projection = gemm_seconds(seq_len, cfg.q_dim / tp, cfg.dim, cluster, efficiency=eff)
    score_bytes = rows * local_seq * seq_len * e
    # q + u and q + v (read q, write each), the position keys expanded over the batch.
    small = (4.0 * micro_batch * local_seq + 2.0 * micro_batch * seq_len) * cfg.q_dim / tp * e
    # The relative shift's pad, the 1/sqrt(K) scale and the masked_fill each read and write
    # the s x T scores; backward runs masked_fill, scale, the slice's and the pad's backward.
    shift_forward = (6.0 * score_bytes + small) / hbm
    shift_backward = (8.0 * score_bytes + small) / hbm
    if settings.flash_attention:  # the fused kernel reads the bias; backward writes its grad
        kernel_forward, kernel_backward = score_bytes / hbm, 2.0 * score_bytes / hbm
    else:  # the math path adds the bias to the scores (2 reads, 1 write)
        kernel_forward, kernel_backward = 3.0 * score_bytes / hbm, 0.0
    # W_R's backward is its weight gradient only (the sinusoids need none).
    forward = scores + projection + shift_forward + kernel_forward
    backward = 2.0 * scores + projection + shift_backward + kernel_backward
    return forward, backward, shift_forward


def _elementwise_forward(cfg: ModelConfig, tokens, tp, sp, e: int, cluster: ClusterSpec,
                         dropout: bool):
    # With dropout, each of the two residual dropouts reads and writes d values and a mask.
    wide = (10.0 * e + (2 * (2 * e + 1) if dropout else 0)) * cfg.dim / np.where(sp, tp, 1)
    split = (2.0 * (cfg.q_dim + cfg.kv_dim) + 3.0 * cfg.ffn_dim) / tp * e
    return tokens * (wide + split) / cluster.hbm_bytes_per_s


def output_projection_recomputed(cols: LayoutColumns, settings: PlanSettings) -> np.ndarray:
    """Rows whose backward recomputes each layer's attention output projection: the trainer's
    block policy (``selective``, and ``none`` under sequence parallelism) with tensor
    parallelism, where that matmul's output is a partial sum it never keeps."""
    block_policy = (cols.activation_checkpointing == _SELECTIVE) | (
        (cols.activation_checkpointing != _FULL) & cols.sequence_parallel)
    return block_policy & (cols.tp > 1) & settings.selective_keeps_matmul_outputs


def compute_columns(cfg: ModelConfig, seq_len: int, cols: LayoutColumns, settings: PlanSettings,
                    cluster: ClusterSpec, mem: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Seconds per step on the busiest device: GEMMs, attention, element-wise, recompute."""
    tp = cols.tp.astype(np.float64)
    cp = cols.cp.astype(np.float64)
    mbs = cols.micro_batch_size.astype(np.float64)
    local_seq = seq_len / cp
    tokens = mbs * local_seq
    m = mem["microbatches"]
    eff = settings.compute_efficiency
    gemm_f, down_f = _layer_gemms(cfg, tokens, tp, cluster, eff)
    attn_f = _attention_forward(cfg, mbs, local_seq, seq_len, tp, cluster, settings, eff)
    rel_f, rel_b, rel_elem_f = _relative_position_seconds(cfg, mbs, local_seq, seq_len, tp,
                                                          cluster, settings, eff)
    elem_f = _elementwise_forward(cfg, tokens, tp, cols.sequence_parallel,
                                  settings.activation_bytes, cluster, settings.attention_dropout)
    head_f = gemm_seconds(tokens, cfg.padded_vocab_size / tp, cfg.embed_dim, cluster,
                          efficiency=eff)
    loss = tokens * 12.0 * cfg.padded_vocab_size / tp / cluster.hbm_bytes_per_s
    policy = cols.activation_checkpointing
    skipped = down_f if settings.checkpoint_early_stop and early_stop_skips_down(cfg) else 0.0
    # the trainer's block policy recomputes the attention output projection under tensor
    # parallelism (its output, a partial sum, is never kept: `parallel.checkpointing`)
    wo_f = np.where(output_projection_recomputed(cols, settings),
                    gemm_seconds(tokens, cfg.dim, cfg.q_dim / tp, cluster, efficiency=eff), 0.0)
    recompute = np.select(
        [policy == _FULL, policy == _SELECTIVE],
        [gemm_f - skipped + attn_f + elem_f + rel_f,
         elem_f + rel_elem_f + (0.0 if settings.flash_attention else attn_f) + wo_f],
        default=wo_f)
    # The trainer's split (`layout_check.balanced_split`): the fullest stage has ceil(L / pp)
    # layers, the last floor(L / pp) (ceil when every stage but the first has one more) + the
    # head; the busiest device is the slower of the two.
    base, extra = np.floor(cfg.num_layers / cols.pp), cfg.num_layers % cols.pp
    fullest = np.where(cols.pp == 1, cfg.num_layers, np.where(extra > 0, base + 1, base))
    last = np.where(cols.pp == 1, cfg.num_layers, base + (extra >= cols.pp - 1))
    attention_s = 3.5 * attn_f + rel_f + rel_b
    layer_s = 3.0 * gemm_f + attention_s + 3.0 * elem_f + recompute
    head_s = 3.0 * head_f + loss
    on_last = last * layer_s + head_s >= fullest * layer_s
    stage_layers = np.where(on_last, last, fullest)
    per_mb = {
        "gemm_s": 3.0 * (gemm_f * stage_layers + head_f * on_last),
        "attention_s": attention_s * stage_layers,
        "elementwise_s": 3.0 * elem_f * stage_layers + loss * on_last,
        "recompute_s": recompute * stage_layers,
    }
    return {k: v * m for k, v in per_mb.items()}
