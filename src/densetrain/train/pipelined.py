"""The trainer's pipeline-parallel path (``parallel.pp > 1``).

`build_pipelined_model` builds this rank's stages with `parallel.pipeline.build_pipeline` (each
stage parallelized with the rest of the layout and initialised from the run's seed) and puts them
under one `PipelinedModel`, whose parameter names are those of the full model: the split keeps
layer keys (``layers.<i>``) and the embedding/head names, so checkpoints of a pipelined run hold
the same names as any other layout and DCP reshards them. `pipeline_step` is the optimizer step
through the pipeline schedule.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from densetrain.train.step import StepOutput, finish_step


class PipelinedModel(nn.Module):
    """This rank's pipeline stage modules as one module named like the full `Transformer`.

    Not callable: the pipeline schedule (``.pipeline``) runs the stages. The children are the
    stages' own modules (shared, not copied), so optimizers, ``state_dict`` and DCP see the real
    (possibly FSDP-sharded) parameters.
    """

    def __init__(self, pipeline: Any) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.layers = nn.ModuleDict()
        for stage in pipeline.modules:
            for name, child in stage.named_children():
                if name == "layers":
                    for key, layer in child.items():
                        self.layers[key] = layer
                elif child is not None and getattr(self, name, None) is None:
                    setattr(self, name, child)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Not supported: a pipelined model runs through ``pipeline.step``."""
        raise RuntimeError("a pipelined model runs through its schedule (pipeline.step)")


def pipeline_microbatches(job: Any, dims: Any) -> int:
    """Pipeline microbatches per step: ``parallel.pp_microbatches``, or when 0 the rank's batch
    over ``training.micro_batch_size`` (so a microbatch has the usual number of sequences)."""
    local_batch = job.training.global_batch_size // dims.dp_size
    count = job.parallel.pp_microbatches or local_batch // job.training.micro_batch_size
    if local_batch % count != 0:
        raise ValueError(
            f"parallel.pp={dims.pp}: the rank's batch of {local_batch} sequences does not split "
            f"into {count} pipeline microbatches; set parallel.pp_microbatches to a divisor"
        )
    if job.parallel.pp_schedule != "gpipe" and count < dims.pp:
        raise ValueError(
            f"parallel.pp={dims.pp} with pp_schedule={job.parallel.pp_schedule!r} needs at least "
            f"pp microbatches per step, got {count} (rank batch {local_batch} / "
            f"training.micro_batch_size={job.training.micro_batch_size}); lower "
            "training.micro_batch_size or set parallel.pp_microbatches"
        )
    return count


def build_pipelined_model(job: Any, dims: Any, mesh: Any, model_cfg: Any,
                          device: torch.device) -> PipelinedModel:
    """This rank's stages of ``model_cfg`` (parallelized, initialised) and their schedule."""
    from densetrain.models import Transformer
    from densetrain.models.loss import cross_entropy_loss
    from densetrain.parallel.pipeline import bubble_fraction, build_pipeline

    if job.parallel.zero_stage < 3:
        raise ValueError(
            f"parallel.pp={dims.pp} composes with parallel.zero_stage=3 (FSDP) only, got "
            f"zero_stage={job.parallel.zero_stage}"
        )
    if job.training.compile:
        raise ValueError(f"training.compile is not supported with parallel.pp={dims.pp}")
    cfg = dataclasses.replace(job.parallel, pp_microbatches=pipeline_microbatches(job, dims))
    virtual = cfg.pp_virtual_stages
    if dist.get_rank() == 0:
        print(
            f"pipeline: {dims.pp} stages x {virtual} virtual, schedule {cfg.pp_schedule}, "
            f"{cfg.pp_microbatches} microbatches; bubble fraction (p-1)/(v*m+p-1) = "
            f"{bubble_fraction(dims.pp, cfg.pp_microbatches, virtual):.3f} "
            "(Narayanan et al. 2021)",
            file=sys.stderr,
        )

    def make_stage() -> nn.Module:
        with torch.device(device):
            return Transformer(model_cfg)

    def stage_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(logits_BSV, targets_BS, ignore_index=model_cfg.ignore_index,
                                  z_loss_coef=model_cfg.z_loss_coef).loss

    pipeline = build_pipeline(make_stage, dims, mesh, cfg, stage_loss,
                              init_seed=job.training.seed, device=device)
    return PipelinedModel(pipeline)


def pipeline_clip_fn(pp_group: Any) -> Callable[[Any, float], torch.Tensor]:
    """Global-norm clipping over the gradients of every stage (all pp ranks)."""
    from densetrain.optim import clip_grad_norm_

    return lambda params, max_norm: clip_grad_norm_(params, max_norm, pp_group=pp_group)


def pipeline_step(
    model: PipelinedModel,
    optimizer: Any,
    batch: Any,
    *,
    clip_grad_norm: Callable[[Any, float], torch.Tensor],
    grad_clip: float,
    nan_policy: str,
    step: int,
    ignore_index: int,
    pp_group: Any,
) -> StepOutput:
    """One optimizer step through the pipeline schedule over this rank's whole batch.

    The schedule splits the batch into its microbatches and averages their losses; the mean is
    computed on the rank of the last stage and summed over the pp group (the other ranks add
    zero) so that every rank reports it and takes the same NaN decision.
    """
    if batch.document_ids is not None or batch.positions is not None:
        raise ValueError("pipeline parallel runs the plain causal mask only; turn off document "
                         "masking in the data config")
    loss = model.pipeline.step(batch.inputs, batch.targets)
    if loss is None:
        loss_sum = torch.zeros((), device=batch.inputs.device)
    else:
        loss_sum = loss.detach().float()
    dist.all_reduce(loss_sum, group=pp_group)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = clip_grad_norm(params, grad_clip if grad_clip > 0 else math.inf)
    total_tokens = (batch.targets != ignore_index).sum()
    return finish_step(optimizer, loss_sum, grad_norm, total_tokens, nan_policy=nan_policy,
                       step=step)
