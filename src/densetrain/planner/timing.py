"""Predicted step time: compute at an efficiency, exposed communication, pipeline bubble.

- Compute: hardware FLOPs of the busiest device / (peak x ``compute_efficiency``). The busiest
  device is on the busiest pipeline stage (``compute.stage_imbalance``).
- Tensor-parallel and pipeline point-to-point traffic sit on the critical path (not overlapped).
- Context-parallel ring traffic overlaps the attention it feeds; only the excess shows.
- Data-parallel traffic overlaps compute where the schedule allows: gradient reductions that run
  once a step hide behind the last microbatch's backward (2/3 of it), per-microbatch
  reduce-scatters behind each backward, parameter all-gathers behind a forward (1/3).
- Pipeline bubble: (pp - 1) / (v m) of the per-device busy time (GPipe and 1F1B: v = 1;
  interleaved 1F1B: v virtual stages; Narayanan et al. 2021).
- Optimizer step: HBM traffic of the locally updated parameters.
"""

from __future__ import annotations

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.planner.compute import (
    attention_core_flops_per_token,
    model_flops_per_token,
    recompute_flops_per_token,
    stage_imbalance,
)
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import LayoutColumns, PlanSettings


def time_columns(cfg: ModelConfig, seq_len: int, global_batch: int, cols: LayoutColumns,
                 settings: PlanSettings, cluster: ClusterSpec, mem: dict[str, np.ndarray],
                 comm: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Step-time components (seconds), tokens/s and MFU for every row."""
    devices = (cols.dp * cols.tp * cols.pp * cols.cp).astype(np.float64)
    tokens = float(global_batch * seq_len)
    model_tok = model_flops_per_token(cfg, seq_len)
    extra_tok = recompute_flops_per_token(cfg, seq_len, cols.activation_checkpointing,
                                          settings.flash_attention)
    imbalance = stage_imbalance(cfg, seq_len, cols.pp)
    rate = cluster.peak_flops * settings.compute_efficiency
    compute = (model_tok + extra_tok) * tokens / devices * imbalance / rate
    m = mem["microbatches"]
    per_mb = compute / m
    attention_share = 3 * attention_core_flops_per_token(cfg, seq_len) / model_tok
    cp_exposed = np.maximum(0.0, comm["cp_s"] - attention_share * compute)
    dp_exposed = _dp_exposed(cols.zero_stage, m, per_mb, comm)
    v = cols.pp_virtual_stages.astype(np.float64)
    bubble = (cols.pp - 1) / (v * m) * (compute + comm["tp_s"] + cp_exposed)
    opt_params = mem["stage_params"] / np.where(cols.zero_stage >= 1, cols.dp_shard, 1)
    optimizer = opt_params * settings.optimizer_bytes_touched / cluster.hbm_bytes_per_s
    step = compute + bubble + comm["tp_s"] + comm["pp_s"] + cp_exposed + dp_exposed + optimizer
    tokens_per_s = tokens / step
    mfu = model_tok * tokens_per_s / (devices * cluster.peak_flops)
    return {"compute_s": compute, "bubble_s": bubble, "tp_exposed_s": comm["tp_s"],
            "pp_exposed_s": comm["pp_s"], "cp_exposed_s": cp_exposed, "dp_exposed_s": dp_exposed,
            "optimizer_s": optimizer, "step_s": step, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "model_flops_per_step": np.full(len(cols), model_tok * tokens),
            "hardware_flops_per_step": (model_tok + extra_tok) * tokens * np.ones(len(cols))}


def _dp_exposed(stage, m, per_mb, comm: dict[str, np.ndarray]) -> np.ndarray:
    backward, forward = 2.0 / 3.0 * per_mb, 1.0 / 3.0 * per_mb
    ar, rs, ag, rep = (comm[k] for k in ("dp_allreduce_s", "dp_reduce_scatter_s",
                                         "dp_all_gather_s", "dp_replicate_s"))
    hide = lambda t, window: np.maximum(0.0, t - window)  # noqa: E731
    stage0 = hide(ar, backward)
    stage1 = hide(rs + rep, backward) + hide(ag, forward)
    stage2 = m * hide(rs, backward) + hide(rep, backward) + hide(ag, forward)
    stage3 = m * (hide(ag, forward) + hide(ag + rs, backward)) + hide(rep, backward)
    return np.select([stage == 0, stage == 1, stage == 2], [stage0, stage1, stage2], stage3)
