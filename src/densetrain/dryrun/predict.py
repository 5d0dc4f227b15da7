"""The planner's prediction for the layout a dry run traces, to print beside the traced bytes.

The planner is given the trainer's real per-parameter bytes: fp32 parameters and gradients, two
fp32 AdamW moments, and all-gathers in bf16 where FSDP gathers in the bf16 compute dtype
(``parallel.fsdp_param_dtype = "compute"``: the ``fsdp2-bf16`` precision of
`planner.layout.PRECISIONS`), else in fp32 (``fp32``); activations in 2 bytes under bf16 or
float8 autocast, 4 in fp32.
"""

from __future__ import annotations

import torch

from densetrain.config.job import JobConfig


def planner_memory(job: JobConfig, world_size: int, pp_rank: int | None = None
                   ) -> dict[str, float]:
    """Predicted bytes per device (``params``, ``grads``, ``optimizer``, ``activations``,
    ``head``, ``buffers``, ``total``) for ``job`` on ``world_size`` ranks: of the fullest
    pipeline rank, or of pipeline rank ``pp_rank`` (its activations and receive buffers)."""
    from densetrain.parallel.mesh import ParallelDims
    from densetrain.parallel.parallelize import fsdp_gather_dtype
    from densetrain.planner.hardware import get_cluster
    from densetrain.planner.layout import Layout, PlanSettings
    from densetrain.planner.search import evaluate_layout

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
    gathers_bf16 = stage == 3 and fsdp_gather_dtype(par, compute) == torch.bfloat16
    # the optimizer the dry run builds (`run._optimizer_as_on_device`): foreach AdamW on a CPU
    # job, whose step allocates a copy of the rank's parameters; fused elsewhere
    foreach = job.optim.name == "adamw" and (job.optim.fused is False or (
        job.optim.fused is None and job.training.device == "cpu"))
    settings = PlanSettings(precision="fsdp2-bf16" if gathers_bf16 else "fp32",
                            activation_bytes=4 if job.training.dtype == "fp32" else 2,
                            optimizer_step_temporaries=1.0 if foreach else 0.0)
    keys = ("params", "grads", "optimizer", "activations", "head", "buffers", "optimizer_step",
            "total")
    if pp_rank is not None:
        from densetrain.planner.layout import LayoutColumns
        from densetrain.planner.memory import memory_columns

        mem = memory_columns(job.build_model_config(), job.data.seq_len,
                             job.training.global_batch_size, LayoutColumns.from_layouts([layout]),
                             settings, pp_rank=pp_rank)
        return {key: float(mem[key][0]) for key in keys}
    metrics = evaluate_layout(job.build_model_config(), job.data.seq_len,
                              job.training.global_batch_size, layout, get_cluster("h100-80gb"),
                              settings, trainer_rules=False)
    return {key: metrics[f"mem_{key}"] for key in keys}


def planner_by_rank(job: JobConfig, world_size: int, reports) -> dict[int, dict[str, float]]:
    """`planner_memory` for each report's rank, at its pipeline position when there is one."""
    return {r.rank: planner_memory(job, world_size, r.coordinates.get("pp") if job.parallel.pp > 1
                                   else None) for r in reports}
