"""`build_model`: the one entry point from a model config to a model laid out on the ranks.

Meta-device build → `parallelize` (TP/SP → CP → activation checkpointing → compile → FSDP/DDP)
→ materialise on the device → seeded `init_weights`, so every layout starts from bit-identical
weights; with pp > 1 the same per stage (`parallel.pipeline.build_pipeline`) under one
`PipelinedModel`. The result is a `LaidOutModel`, the interface the trainer uses for every layout.

The model is laid out before anything is allocated. Without pipeline parallelism the whole
`Transformer` is built on the meta device, its blocks' linear layers converted to float8 when
asked (`parallel.float8`), `parallelize`d, and only then materialised (``to_empty``) and
initialised. With ``pp > 1``, `_build_pipelined` checks the pipeline rules (ZeRO-3, no compile,
tied embeddings not with ``zbv``), sizes the microbatches and hands `build_pipeline` a factory
that makes the whole model on the meta device; for each stage this rank holds, ``split_stage``
drops the other stages' layers (and the embedding, final norm and head where the stage lacks
them; the last stage of a tied model keeps a copy of ``tok_embeddings`` for its head), the stage
is parallelized on its own, then materialised and initialised. A rank therefore allocates its own
stages' parameters only, never the whole model. The last stage is handed the targets as a keyword
of its forward and returns its loss from the model's own ``loss_head`` (vocab-parallel and
chunked under TP), so no stage returns full-vocabulary logits; the schedule's loss function
(``pipeline.stage_loss``) only picks the loss out. FSDP gathers parameters in the compute dtype
(``parallel.param_dtype``, `parallelize.fsdp_gather_dtype`: bf16 under bf16 autocast) and
reduces gradients in fp32. Materialisation and initialisation run inside
``build_model(materialize=...)``, which the dry run (``densetrain.dryrun``) sets to
``FakeTensorMode``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from densetrain.models.config import ModelConfig
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.float8 import convert_blocks_to_float8
from densetrain.parallel.layout_check import layout_on_mesh, require
from densetrain.parallel.mesh import ParallelDims, ParallelMesh
from densetrain.parallel.model import LaidOutModel, PipelineParallelModel, SpmdModel, model_loss_fn

_MICROBATCH_RULES = ("batch_splits", "pp_microbatches_divide_batch",
                     "pp_microbatches_fill_pipeline", "pp_interleaved_rounds")
"""The rules a pipeline's microbatch count must pass (`parallel.layout_check`)."""


def pipeline_microbatches(cfg: ParallelConfig, dims: ParallelDims, *, local_batch_size: int,
                          micro_batch_size: int) -> int:
    """Pipeline microbatches per step on ``dims`` with ``cfg``'s options, for a caller without
    a run's layout (a run reads ``ResolvedLayout.microbatches``). Raises ``UserError`` (the
    pipeline rules of ``parallel.layout_check``) when they do not split the batch or fill the
    pipeline."""
    layout = layout_on_mesh(dims, cfg, local_batch_size=local_batch_size,
                            micro_batch_size=micro_batch_size)
    require(_MICROBATCH_RULES, layout)
    return layout.microbatches


def build_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    pmesh: ParallelMesh,
    *,
    device: torch.device,
    seed: int,
    compile: bool = False,
    loss_chunk_size: int | None = None,
    local_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    float8_recipe: str = "",
    compute_dtype: torch.dtype | None = None,
    materialize: Callable[[], AbstractContextManager] = nullcontext,
) -> LaidOutModel:
    """``model_cfg`` laid out on ``pmesh`` as ``parallel_cfg`` says, initialised from ``seed``.

    ``loss_chunk_size`` selects the chunked output head (None: full logits). ``compute_dtype``
    is autocast's dtype (None: none): FSDP gathers parameters in it as ``param_dtype``
    says. The layout is the run's (``pmesh.layout``, checked where the run was built); on a
    mesh without one (a direct call) it is the mesh's degrees with ``parallel_cfg``'s options,
    and the rules this builder relies on are checked here: then pipeline parallel needs
    ``local_batch_size`` and ``micro_batch_size`` to size its microbatches. A
    ``float8_recipe`` runs the blocks' linear layers in float8 (`parallel.float8`). The
    meta-device model is laid out first; only its materialisation and initialisation run inside
    ``materialize()`` (a dry run passes ``FakeTensorMode``, so that the layout code, which
    reads the mesh's real rank tables, runs as in a real run).
    """
    from densetrain.models import Transformer
    from densetrain.parallel.parallelize import fsdp_gather_dtype, init_weights, parallelize

    gather = fsdp_gather_dtype(parallel_cfg, compute_dtype)
    chunk = loss_chunk_size if loss_chunk_size and loss_chunk_size > 0 else None
    if float8_recipe and pmesh.layout is None:
        require(("float8_without_tp",), layout_on_mesh(pmesh.dims, parallel_cfg, float8=True),
                model_cfg)
    if pmesh.dims.pp > 1:
        return _build_pipelined(model_cfg, parallel_cfg, pmesh, device=device, seed=seed,
                                compile=compile, local_batch_size=local_batch_size,
                                micro_batch_size=micro_batch_size, float8_recipe=float8_recipe,
                                loss_chunk_size=chunk, gather_dtype=gather,
                                materialize=materialize)
    with torch.device("meta"):
        module = Transformer(model_cfg)
    if float8_recipe:
        convert_blocks_to_float8(module, float8_recipe)
    module = parallelize(module, pmesh, parallel_cfg, compile=compile, gather_dtype=gather)
    with materialize():
        module.to_empty(device=device)
        init_weights(module, seed)
    return SpmdModel(module=module, pmesh=pmesh, loss_fn=model_loss_fn(chunk),
                     ignore_index=model_cfg.ignore_index)


def _build_pipelined(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, pmesh: ParallelMesh,
                     *, device: torch.device, seed: int, compile: bool,
                     local_batch_size: int | None, micro_batch_size: int | None,
                     float8_recipe: str, loss_chunk_size: int | None,
                     gather_dtype: torch.dtype | None,
                     materialize: Callable[[], AbstractContextManager]) -> LaidOutModel:
    """This rank's stages (parallelized, initialised), their schedule, one `PipelinedModel`.

    The last stage computes its loss in its own forward (the model's ``loss_head``: under
    tensor parallel the vocab-parallel loss over the rank's slice of the head, chunked with
    ``loss_chunk_size``), as an unpipelined model does: no stage ever returns full-vocabulary
    logits (8,192 tokens x 128,256 entries in fp32 is 4.2 GB per microbatch at Llama 3 sizes).
    The schedule's loss function only picks the loss out of the stage's `LossOutput`
    (`parallel.pipeline.stage_loss`)."""
    from densetrain.models import Transformer
    from densetrain.parallel.pipeline import PipelinedModel, bubble_fraction, build_pipeline

    layout = pmesh.layout
    if layout is None:  # a direct call: check what this builder relies on
        layout = layout_on_mesh(pmesh.dims, parallel_cfg, model_cfg, compile=compile,
                                local_batch_size=local_batch_size or 0,
                                micro_batch_size=micro_batch_size or 0)
        require(("pp_needs_zero3", "pp_without_compile", "pp_tied_without_zbv"), layout,
                model_cfg)
        if local_batch_size is None or micro_batch_size is None:
            raise ValueError("pipeline parallel needs the rank's batch and micro-batch sizes")
        require(_MICROBATCH_RULES, layout)
    count = layout.microbatches
    cfg = parallel_cfg
    if dist.get_rank() == 0:
        print(f"pipeline: {layout.pp} stages x {layout.pp_virtual_stages} virtual, schedule "
              f"{layout.pp_schedule}, {count} microbatches; bubble fraction (p-1)/(v*m+p-1) = "
              f"{bubble_fraction(layout.pp, count, layout.pp_virtual_stages):.3f} "
              "(Narayanan et al. 2021)", file=sys.stderr)

    def make_stage() -> torch.nn.Module:
        # On the meta device: `build_pipeline` drops the other stages' layers before anything
        # is allocated, so a rank holds only its stages' parameters, never the whole model.
        with torch.device("meta"):
            stage = Transformer(model_cfg)
        return convert_blocks_to_float8(stage, float8_recipe) if float8_recipe else stage

    pipeline = build_pipeline(make_stage, pmesh, cfg, num_layers=model_cfg.num_layers,
                              microbatches=count, init_seed=seed, device=device,
                              materialize=materialize,
                              loss_chunk_size=loss_chunk_size, gather_dtype=gather_dtype)
    return PipelineParallelModel(module=PipelinedModel(pipeline), pmesh=pmesh, pipeline=pipeline,
                                 ignore_index=model_cfg.ignore_index)
