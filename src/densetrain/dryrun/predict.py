"""The planner's prediction for the layout a dry run traces, to print beside the traced bytes.

The planner is given the trainer's real per-parameter bytes: fp32 parameters and gradients, two
fp32 AdamW moments, and all-gathers in bf16 where FSDP gathers in the bf16 compute dtype
(``parallel.param_dtype = "compute"``: the ``fsdp2-bf16`` precision of
`planner.layout.PRECISIONS`; on a layout without sharded data parallelism FSDP over one rank,
``PlanSettings.single_rank_fsdp``), else in fp32 (``fp32``); activations in 2 bytes under bf16 or
float8 autocast, 4 in fp32; attention as the CPU kernels the trace runs (without the fused
kernel under dropout). The CUDA workspace (``PlanSettings.workspace_gb``), which no trace
on the CPU can see, is left out of the prediction compared with the trace.
"""

from __future__ import annotations

import torch

from densetrain.config.job import JobConfig


def _layout_and_settings(job: JobConfig, world_size: int):
    """The planner's `Layout` of ``job`` on ``world_size`` ranks and the `PlanSettings` of the
    trainer's real bytes (module docstring)."""
    from densetrain.parallel.mesh import ParallelDims
    from densetrain.parallel.parallelize import fsdp_gather_dtype, single_rank_fsdp
    from densetrain.planner.layout import Layout, PlanSettings

    par = job.parallel
    dims = ParallelDims.from_config(par, world_size)
    stage = par.zero_stage if dims.dp_shard > 1 else 0
    layout = Layout(
        tp=dims.tp, sequence_parallel=bool(par.sequence_parallel and dims.tp > 1), pp=dims.pp,
        pp_schedule=par.pp_schedule, pp_virtual_stages=par.pp_virtual_stages, cp=dims.cp,
        dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, zero_stage=stage,
        activation_checkpointing=par.activation_checkpointing,
        micro_batch_size=job.training.micro_batch_size)
    compute = torch.bfloat16 if job.training.dtype == "bf16" else None
    single = single_rank_fsdp(par, dims, compute)
    gathers_bf16 = single or (stage == 3 and fsdp_gather_dtype(par, compute) == torch.bfloat16)
    # the optimizer the dry run builds (`run._optimizer_as_on_device`): foreach AdamW on a CPU
    # job, whose step allocates a copy of the rank's parameters; fused elsewhere
    foreach = job.optim.name == "adamw" and (job.optim.fused is False or (
        job.optim.fused is None and job.training.device == "cpu"))
    # the CUDA context, communication and matmul workspaces (``workspace_gb``) are not tensors
    # a trace on the CPU sees: the prediction compared leaves them out
    settings = PlanSettings(precision="fsdp2-bf16" if gathers_bf16 else "fp32",
                            activation_bytes=4 if job.training.dtype == "fp32" else 2,
                            optimizer_step_temporaries=1.0 if foreach else 0.0,
                            pp_accumulates_unsharded_grads=par.pp_grad_reduce == "step",
                            pp_reshards_after_forward=par.pp_reshard_after_forward,
                            single_rank_fsdp=single,
                            # the trace runs the CPU's attention kernels, whose fused (flash)
                            # kernel takes no dropout: with dropout attention is the explicit
                            # softmax, its probabilities kept (CUDA's flash kernel drops out)
                            flash_attention=not job.build_model_config().dropout,
                            workspace_gb=0.0)
    return layout, settings


def _evaluate(job: JobConfig, world_size: int) -> dict:
    from densetrain.planner.hardware import get_cluster
    from densetrain.planner.search import evaluate_layout

    layout, settings = _layout_and_settings(job, world_size)
    return evaluate_layout(job.build_model_config(), job.data.seq_len,
                           job.training.global_batch_size, layout, get_cluster("h100-80gb"),
                           settings, trainer_rules=False)


def _rank_memory(job: JobConfig, world_size: int, pp_rank: int):
    """(model config, layout columns, settings, the planner's memory columns) of pipeline rank
    ``pp_rank``'s own stage."""
    from densetrain.planner.layout import LayoutColumns
    from densetrain.planner.memory import memory_columns

    layout, settings = _layout_and_settings(job, world_size)
    cols = LayoutColumns.from_layouts([layout])
    cfg = job.build_model_config()
    mem = memory_columns(cfg, job.data.seq_len, job.training.global_batch_size, cols, settings,
                         pp_rank=pp_rank)
    return cfg, cols, settings, mem


def planner_memory(job: JobConfig, world_size: int, pp_rank: int | None = None
                   ) -> dict[str, float]:
    """Predicted bytes per device (``params``, ``grads``, ``optimizer``, ``activations``,
    ``head``, ``buffers``, ``total``) for ``job`` on ``world_size`` ranks: of the fullest
    pipeline rank, or of pipeline rank ``pp_rank`` (its activations and receive buffers)."""
    keys = ("params", "grads", "optimizer", "activations", "head", "buffers", "optimizer_step",
            "total")
    if pp_rank is not None:
        mem = _rank_memory(job, world_size, pp_rank)[3]
        return {key: float(mem[key][0]) for key in keys}
    metrics = _evaluate(job, world_size)
    return {key: metrics[f"mem_{key}"] for key in keys}


COMM_KINDS = ("tp", "dp", "pp", "cp")
"""The planner's communication kinds (`planner.comm.comm_columns`), by the mesh dimension that
carries them: tp, dp (dp_shard and dp_replicate, flattened or not), pp, cp."""


def planner_comm(job: JobConfig, world_size: int, pp_rank: int | None = None
                 ) -> dict[str, float]:
    """The planner's bytes sent per device and step, by `COMM_KINDS` (ring collectives:
    all-reduce 2(n-1)/n of the payload, all-gather and reduce-scatter (n-1)/n). The planner's
    pipeline traffic is a middle stage's (activations forward and gradients back); with
    ``pp_rank`` the counts are of that rank's stages, of which the pipeline's first and last
    send one direction only."""
    if pp_rank is None:
        metrics = _evaluate(job, world_size)
        out = {kind: float(metrics[f"{kind}_bytes"]) for kind in COMM_KINDS}
    else:  # the rank's own stage (its layers and parameters), not the fullest
        from densetrain.planner.comm import comm_columns
        from densetrain.planner.hardware import get_cluster

        cfg, cols, settings, mem = _rank_memory(job, world_size, pp_rank)
        comm = comm_columns(cfg, job.data.seq_len, cols, settings, get_cluster("h100-80gb"), mem)
        out = {kind: float(comm[f"{kind}_bytes"][0]) for kind in COMM_KINDS}
    par = job.parallel
    if pp_rank is not None and par.pp > 1:
        # the pipeline's first stage sends no gradients back, its last no activations on: a
        # rank holding one of them sends in 2v - 1 of its 2v directions (ZB-V's V puts both
        # on rank 0)
        ends = 2 * (pp_rank == 0) if par.pp_schedule == "zbv" else (
            (pp_rank == 0) + (pp_rank == par.pp - 1))
        v = par.pp_virtual_stages
        out["pp"] *= (2 * v - ends) / (2 * v)
    return out


def traced_comm(report, job: JobConfig) -> dict[str, float | None]:
    """The traced collectives of ``report`` as the planner counts them: bytes each rank sends per
    step with ring collectives (the payload times the ring factor of the group's size; a send's
    payload; receives are counted by their sender), by `COMM_KINDS`. The traced micro-batches
    stand for the step's: their traffic is scaled by microbatches per step over traced ones,
    except data-parallel traffic under pipeline parallelism (`pipelined_fsdp_calls`); None
    where that traffic does not follow the rule the extrapolation needs."""
    from densetrain.parallel.mesh import FLATTENED_AXES, ParallelDims
    from densetrain.planner.comm import ring_factor

    dims = ParallelDims.from_config(job.parallel, report.world_size)
    scale = report.microbatches / report.traced_microbatches
    out: dict[str, float | None] = dict.fromkeys(COMM_KINDS, 0.0)
    for c in report.collectives:
        axes = FLATTENED_AXES.get(c.group, (c.group,))
        if any(a not in ("pp", "dp_replicate", "dp_shard", "cp", "tp") for a in axes):
            continue  # a group the report could not name
        size = 1
        for axis in axes:
            size *= dims.degree(axis)
        kind = axes[0] if axes[0] in ("tp", "pp", "cp") else "dp"
        if c.kind in ("all_gather", "reduce_scatter", "all_reduce"):
            factor = float(ring_factor(size, c.kind))
        else:
            factor = 1.0 if c.kind in ("send", "broadcast", "all_to_all") else 0.0
        if kind == "dp" and report.stage_chunks:
            payload = pipelined_fsdp_calls(report, c)
            if payload is None or out[kind] is None:
                out[kind] = None
                continue
        else:
            payload = c.bytes * scale
        out[kind] += payload * factor
    return out


def pipelined_fsdp_calls(report, collective) -> float | None:
    """Payload bytes a step moves in ``collective`` (a data-parallel one) on a pipeline rank,
    from the traced microbatches, or None where the trace does not follow the rule below.

    Under torch's GPipe and 1F1B schedules a stage stays gathered from one
    microbatch's backward to the next forward, so each FSDP unit gathers ``c + 1`` times over
    ``c`` microbatches, except each stage's last block (never resharded after forward), which
    gathers once; gradients are reduced once, by the last backward (with
    ``parallel.pp_grad_reduce = "microbatch"``, by every backward)
    (`planner.comm.fsdp_calls_per_step`, which models the same from the config). The trace is
    checked against that rule call by call: of the calls of each size, all but ``size mod
    (c + 1)`` come in runs of ``c + 1`` (the units' gathers; a step of ``m`` microbatches makes
    ``m + 1``), the rest are the once-a-step gathers, one per stage; each unit reduces once. A
    trace that breaks the rule (torch's runtime for the interleaved and zero-bubble schedules
    gathers otherwise) is not extrapolated."""
    runs = report.traced_microbatches + 1
    units, chunks = report.fsdp_units, report.stage_chunks
    if collective.kind == "all_gather":
        once = {size: calls % runs for size, calls in collective.sizes.items()}
        if sum(once.values()) != chunks or collective.calls != runs * (units - chunks) + chunks:
            return None
        per_run = (report.microbatches + 1) / runs
        return sum(size * ((calls - once[size]) * per_run + once[size])
                   for size, calls in collective.sizes.items())
    if collective.kind == "reduce_scatter" and collective.calls != units:
        # ``parallel.pp_grad_reduce = "microbatch"``: each unit reduces after every backward
        if units and collective.calls == units * report.traced_microbatches:
            return collective.bytes * report.microbatches / report.traced_microbatches
        return None
    return float(collective.bytes)  # reductions and the norm's all-reduce: once a step


def planner_by_rank(job: JobConfig, world_size: int, reports) -> dict[int, dict[str, float]]:
    """`planner_memory` for each report's rank, at its pipeline position when there is one."""
    return {r.rank: planner_memory(job, world_size, r.coordinates.get("pp") if job.parallel.pp > 1
                                   else None) for r in reports}


def comm_by_rank(job: JobConfig, world_size: int, reports) -> dict[int, dict[str, tuple]]:
    """Per report's rank and `COMM_KINDS` kind: (traced, planner) bytes sent per step, or
    (traced, None) where the two cannot be compared; traced None: the traced microbatches do
    not extrapolate to the step (`pipelined_fsdp_calls`)."""
    out = {}
    for r in reports:
        pp_rank = r.coordinates.get("pp", 0) if job.parallel.pp > 1 else None
        traced, planned = traced_comm(r, job), planner_comm(job, world_size, pp_rank)
        rows = {}
        for kind in COMM_KINDS:
            if traced[kind] == 0 and not planned[kind]:
                continue
            rows[kind] = (traced[kind], planned[kind] if traced[kind] is not None else None)
        out[r.rank] = rows
    return out
