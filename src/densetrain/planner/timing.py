"""Predicted step time: per-operation compute, exposed communication, pipeline bubble.

- Compute: GEMMs by shape, attention and memory-bound element-wise work of the busiest device
  (``ops.compute_columns``).
- Tensor-parallel traffic sits on the critical path except ``PlanSettings.tp_overlap`` of it;
  pipeline point-to-point traffic is exposed.
- Context-parallel ring traffic overlaps the attention it feeds; only the excess shows.
- Data-parallel traffic overlaps compute where the schedule allows: gradient reductions that run
  once a step hide behind the last microbatch's backward (2/3 of it), per-microbatch
  reduce-scatters behind each backward, parameter all-gathers behind a forward (1/3); with
  ``PlanSettings.dp_overlap=False`` none of it is hidden.
- Pipeline bubble, per schedule, as a share of the per-device busy time: GPipe and 1F1B
  (p - 1) / m (the same idle slots; 1F1B only holds fewer activations, Narayanan et al. 2021
  sec. 2.2.1); interleaved 1F1B (p - 1) / (v m) (sec. 2.2.2); the interleaved zero-bubble
  schedule a third of interleaved 1F1B's (Qi et al. 2023, ZB-H1: backward split into input and
  weight gradients fills (T_F + T_B - T_W) of each (T_F + T_B + T_W) slot, a third with equal
  thirds); ZB-V none once m >= 2p - 1 (Qi et al. 2023 sec. 4), else ZB-H1's.
- Optimizer step: HBM traffic of the locally updated parameters.
- Host time: ``ClusterSpec.layer_host_s`` per layer and microbatch of the busiest stage (plus
  what tensor parallelism and FSDP add, ``tp_``/``fsdp_layer_host_s``), a third more with
  full recompute (its forward again), and ``optimizer_layer_host_s`` (likewise) per layer and
  step; measured by ``plan --calibrate`` on CPUs, 0 on GPUs.
"""

from __future__ import annotations

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.planner.compute import hardware_flops_per_token, model_flops_per_token
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import AC_POLICIES, PP_SCHEDULES, LayoutColumns, PlanSettings
from densetrain.planner.ops import compute_columns, output_projection_recomputed


def time_columns(cfg: ModelConfig, seq_len: int, global_batch: int, cols: LayoutColumns,
                 settings: PlanSettings, cluster: ClusterSpec, mem: dict[str, np.ndarray],
                 comm: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Step-time components (seconds), tokens/s and MFU for every row."""
    devices = (cols.dp * cols.tp * cols.pp * cols.cp).astype(np.float64)
    tokens = float(global_batch * seq_len)
    model_tok = model_flops_per_token(cfg, seq_len)
    hardware_tok = hardware_flops_per_token(cfg, seq_len, cols.activation_checkpointing,
                                            settings.flash_attention, cols.micro_batch_size,
                                            early_stop=settings.checkpoint_early_stop,
                                            output_projection_recomputed=(
                                                output_projection_recomputed(cols, settings)))
    parts = compute_columns(cfg, seq_len, cols, settings, cluster, mem)
    compute = parts["gemm_s"] + parts["attention_s"] + parts["elementwise_s"] + parts["recompute_s"]
    m = mem["microbatches"]
    per_mb = compute / m
    cp_exposed = np.maximum(0.0, comm["cp_s"] - parts["attention_s"])
    # Without overlap there is no compute window to hide data-parallel traffic behind.
    window = per_mb if settings.dp_overlap else np.zeros_like(per_mb)
    dp_exposed = _dp_exposed(cols.zero_stage, m, window, comm)
    tp_exposed = comm["tp_s"] * (1.0 - settings.tp_overlap)
    bubble = bubble_share(cols.pp_schedule, cols.pp, cols.pp_virtual_stages, m) * (
        compute + tp_exposed + cp_exposed)
    opt_params = mem["stage_params"] / np.where(cols.zero_stage >= 1, cols.dp_shard * cols.cp, 1)
    optimizer = opt_params * settings.optimizer_bytes_touched / cluster.hbm_bytes_per_s
    host = host_seconds(cols, mem, cluster)
    step = (compute + bubble + tp_exposed + comm["pp_s"] + cp_exposed + dp_exposed + optimizer
            + host)
    tokens_per_s = tokens / step
    mfu = model_tok * tokens_per_s / (devices * cluster.peak_flops)
    return {**parts, "compute_s": compute, "bubble_s": bubble, "tp_exposed_s": tp_exposed,
            "pp_exposed_s": comm["pp_s"], "cp_exposed_s": cp_exposed, "dp_exposed_s": dp_exposed,
            "optimizer_s": optimizer, "host_s": host, "step_s": step,
            "tokens_per_s": tokens_per_s, "mfu": mfu,
            "model_flops_per_step": np.full(len(cols), model_tok * tokens),
            "hardware_flops_per_step": hardware_tok * tokens}


def host_seconds(cols: LayoutColumns, mem: dict[str, np.ndarray], cluster: ClusterSpec):
    """Host time per step on the busiest device (see the module docstring)."""
    tp, fsdp = cols.tp > 1, (cols.zero_stage == 3) & (cols.dp_shard * cols.cp > 1)

    def per_layer(plain: float, with_tp: float, with_fsdp: float):
        extra_tp = (with_tp or plain) - plain
        extra_fsdp = (with_fsdp or plain) - plain
        return plain + tp * extra_tp + fsdp * extra_fsdp

    c = cluster
    backward = per_layer(c.layer_host_s, c.tp_layer_host_s, c.fsdp_layer_host_s)
    update = per_layer(c.optimizer_layer_host_s, c.tp_optimizer_layer_host_s,
                       c.fsdp_optimizer_layer_host_s)
    recompute = np.where(cols.activation_checkpointing == AC_POLICIES.index("full"), 4 / 3, 1.0)
    return mem["stage_layers"] * (mem["microbatches"] * backward * recompute + update)


def bubble_share(schedule, pp, virtual_stages, microbatches):
    """Bubble time over busy time per schedule (see the module docstring)."""
    p = np.asarray(pp, dtype=np.float64)
    v = np.asarray(virtual_stages, dtype=np.float64)
    m = np.asarray(microbatches, dtype=np.float64)
    base = (p - 1) / m
    names = [PP_SCHEDULES.index(n) for n in ("interleaved_1f1b", "zero_bubble", "zbv")]
    share = np.select(
        [schedule == names[0], schedule == names[1], schedule == names[2]],
        [base / v, base / (3 * v), np.where(m >= 2 * p - 1, 0.0, base / (3 * v))],
        default=base)
    return np.where(p == 1, 0.0, share)


def _dp_exposed(stage, m, per_mb, comm: dict[str, np.ndarray]) -> np.ndarray:
    backward, forward = 2.0 / 3.0 * per_mb, 1.0 / 3.0 * per_mb
    ar, rs, ag, rep = (comm[k] for k in ("dp_allreduce_s", "dp_reduce_scatter_s",
                                         "dp_all_gather_s", "dp_replicate_s"))
    hide = lambda t, window: np.maximum(0.0, t - window)  # noqa: E731
    stage0 = hide(ar, backward)
    stage1 = hide(rs + rep, backward) + hide(ag, forward)
    stage2 = m * hide(rs, backward) + hide(rep, backward) + hide(ag, forward)
    # ZeRO-3: gathers in forward, then in backward beside the reduce-scatters (both once per
    # microbatch without a pipeline; `comm.fsdp_calls_per_step`)
    ag_forward = comm["dp_ag_forward_per_step"]
    ag_backward = comm["dp_ag_per_step"] - ag_forward
    n_rs = comm["dp_rs_per_step"]
    paired = np.minimum(ag_backward, n_rs)
    stage3 = (ag_forward * hide(ag, forward) + paired * hide(ag + rs, backward)
              + (ag_backward - paired) * hide(ag, backward) + (n_rs - paired) * hide(rs, backward)
              + hide(rep, backward))
    return np.select([stage == 0, stage == 1, stage == 2], [stage0, stage1, stage2], stage3)
