"""The plan as a job config: model, batch, layout and activation checkpointing of a planned
layout in the TOML that ``densetrain train`` reads.

The job starts from the embedded default (data, optimizer, schedule, logging) and takes from the
plan: ``[model]`` (the preset by name, or every field of a model given as a file),
``data.seq_len``, ``training.global_batch_size`` and ``micro_batch_size``, and the whole
``[parallel]`` section. It is validated as the trainer validates it, for the layout's world size
and including ``parallel.layout_check``, before it is written (atomically).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.planner.layout import Layout


def plan_job(cfg: ModelConfig, layout: Layout, *, seq_len: int, global_batch: int,
             preset: str | None = None, precision: str = "bf16-mixed"):
    """A validated ``JobConfig`` that trains ``cfg`` with ``layout`` (``ValueError`` if the
    trainer would refuse it), in the dtype of the plan's ``precision`` (a key of
    `planner.layout.PRECISIONS`): fp32, else bf16 autocast, whose 2-byte activations the plan
    counted (an fp32 job holds twice them: a dry run of the 8-GPU Llama 3 8B winner traced
    112 GiB where its bf16 plan said 59)."""
    from densetrain.config import JobConfig, ModelSection, default_job_config
    from densetrain.parallel.config import ParallelConfig

    job: JobConfig = default_job_config()
    if preset:
        model = ModelSection(preset=preset)
    else:
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        model = ModelSection(preset="", **fields)
    job.model = model
    job.data.seq_len = seq_len
    job.training.global_batch_size = global_batch
    job.training.micro_batch_size = layout.micro_batch_size
    job.training.global_batch_tokens = 0
    job.training.dtype = "fp32" if precision == "fp32" else "bf16"
    job.parallel = ParallelConfig(**layout.to_parallel_config())
    try:  # job validation runs parallel.layout_check.check_layout, as the trainer does
        job.validate(world_size=layout.devices)
        return job.resolved(world_size=layout.devices)
    except ValueError as err:
        raise UserError(f"the planned layout cannot run: {err}") from None


def emit_config(path: str | Path, cfg: ModelConfig, layout: Layout, *, seq_len: int,
                global_batch: int, preset: str | None = None,
                precision: str = "bf16-mixed") -> Path:
    """Write the job of `plan_job` to ``path`` (temporary file, then rename); returns the path."""
    from densetrain.config import save_job_config

    job = plan_job(cfg, layout, seq_len=seq_len, global_batch=global_batch, preset=preset,
                   precision=precision)
    return save_job_config(job, path)
