"""Build a run from a `JobConfig`: process group, device, data, model, optimizer, schedules.

The order follows the design map: meta-device model → ``parallelize()`` (TP/SP, CP, activation
checkpointing, compile, FSDP/DDP) → ``to_empty`` → ``init_weights(seed)``, so that every layout
starts from the same weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from densetrain.checkpoint import ModelState, TrainerCounters, load_checkpoint
from densetrain.train.device import autocast_factory, resolve_device
from densetrain.train.metrics import device_peak_flops
from densetrain.train.trainer import RunState, seed_everything


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `Transformer` inside DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def make_loss_fn(model: torch.nn.Module, chunk_size: int):
    """``loss_fn(model, batch) -> LossOutput`` through the model's own ``compute_loss``.

    ``compute_loss`` fuses the output projection with the loss in chunks (no full logits). It is
    not ``forward``, so wrappers that act on ``forward`` need care: FSDP2 is told to treat it as a
    forward method (`register_fsdp_forward_method`); a DDP wrapper must see ``forward``, so under
    DDP the loss is taken from full logits.
    """
    inner = unwrap_model(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        from densetrain.models.loss import cross_entropy_loss

        cfg = inner.config

        def ddp_loss(m: torch.nn.Module, batch: Any):
            logits_BSV = m(batch.inputs, positions_BS=batch.positions,
                           document_ids_BS=batch.document_ids)
            return cross_entropy_loss(logits_BSV, batch.targets, ignore_index=cfg.ignore_index,
                                      z_loss_coef=cfg.z_loss_coef)

        return ddp_loss
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # torch built without distributed
        FSDPModule = ()  # noqa: N806
    if FSDPModule and isinstance(inner, FSDPModule):
        register_fsdp_forward_method(inner, "compute_loss")
    chunk = chunk_size if chunk_size > 0 else None

    def loss_fn(m: torch.nn.Module, batch: Any):
        return inner.compute_loss(
            batch.inputs, batch.targets, positions_BS=batch.positions,
            document_ids_BS=batch.document_ids, chunk_size=chunk,
        )

    return loss_fn


def _init_distributed(job: Any) -> tuple[int, int, int]:
    from densetrain.parallel.distributed import init_distributed

    device_type = resolve_device(job.training.device).type
    info = init_distributed(
        timeout_s=job.parallel.collective_timeout_s,
        device_type="cuda" if device_type == "cuda" else "cpu",
    )
    return info.rank, info.world_size, info.local_rank


def _parallelize(model: torch.nn.Module, dims: Any, mesh: Any, job: Any) -> torch.nn.Module:
    from densetrain.parallel.parallelize import parallelize

    return parallelize(model, dims, mesh, job.parallel, compile=job.training.compile)


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    # parallel.parallelize.init_weights handles DTensor (sharded) parameters; plain models
    # use the model's own seeded init.
    from densetrain.parallel.parallelize import init_weights

    init_weights(unwrap_model(model), seed)


def _build_optimizer(model: torch.nn.Module, dims: Any, mesh: Any, job: Any):
    """The job's optimizer over decay/no-decay groups; ZeRO-1/2 wraps it to shard its state."""
    from densetrain.optim import build_optimizer
    from densetrain.optim.param_groups import param_groups
    from densetrain.parallel.parallelize import build_optimizer as build_parallel_optimizer

    groups = param_groups(
        unwrap_model(model), weight_decay=job.optim.weight_decay,
        decay_embeddings=job.optim.decay_embeddings,
    )
    optimizer = build_parallel_optimizer(
        model, dims, mesh, job.parallel, lambda g: build_optimizer(g, job.optim), groups
    )
    if not isinstance(optimizer, torch.optim.Optimizer) and not hasattr(
        optimizer, "clip_grad_norm_"
    ):
        raise ValueError(
            f"parallel.zero_stage={job.parallel.zero_stage}: the ZeRO-1/2 optimizer does not yet "
            "expose clip_grad_norm_ over its gradient shards, which the trainer needs for "
            "clipping and the NaN check; use parallel.zero_stage=3 (FSDP)"
        )
    return optimizer


def _clip_fn(optimizer: Any, dims: Any, mesh: Any):
    """Global-norm clipping: the optimizer's own (sharded-gradient optimizers), over all pipeline
    stages (pp > 1), or the default."""
    from densetrain.optim import clip_grad_norm_

    if hasattr(optimizer, "clip_grad_norm_"):
        return lambda _params, max_norm: optimizer.clip_grad_norm_(max_norm)
    if dims.pp > 1:
        from densetrain.train.pipelined import pipeline_clip_fn

        return pipeline_clip_fn(_pp_group(dims, mesh))
    return clip_grad_norm_


def _init_from(model: torch.nn.Module, source: str) -> None:
    """Initial weights from a densetrain checkpoint or a Hugging Face model directory."""
    from densetrain.checkpoint import is_complete, latest_checkpoint

    path = Path(source)
    if (path / "config.json").is_file():
        _init_from_hf(model, path)
        return
    if not is_complete(path):
        path = latest_checkpoint(path) or path
    if not is_complete(path):
        raise ValueError(
            f"training.init_from={source!r} is neither a Hugging Face model directory (with "
            "config.json) nor a complete densetrain checkpoint (or a directory holding one)"
        )
    load_checkpoint(path, {"model": ModelState(model)})


def _init_from_hf(model: torch.nn.Module, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from densetrain.models.hf import load_hf

    source = load_hf(path, dtype=torch.float32).state_dict()
    for name, value in get_model_state_dict(model).items():
        if name not in source:
            raise ValueError(f"training.init_from={str(path)!r} has no tensor {name!r}")
        if tuple(source[name].shape) != tuple(value.shape):
            raise ValueError(
                f"training.init_from={str(path)!r}: tensor {name!r} has shape "
                f"{tuple(source[name].shape)} but the job's model expects {tuple(value.shape)}; "
                "set [model] to the checkpoint's architecture"
            )
    set_model_state_dict(model, source, options=StateDictOptions(full_state_dict=True))


def _announce(config_toml: str, counts: Any, world_size: int, device: torch.device,
              peak: float, peak_source: str) -> None:
    print(f"# resolved config\n{config_toml}", file=sys.stderr)
    print(
        f"model: {counts.total / 1e6:.2f}M parameters ({counts.non_embedding / 1e6:.2f}M "
        f"non-embedding), {world_size} process(es) on {device}, peak {peak / 1e12:.3g} "
        f"TFLOP/s ({peak_source})",
        file=sys.stderr,
    )


def build_run(job: Any) -> RunState:
    """Everything the loop needs, built from ``job`` (validated here with the real world size)."""
    from densetrain.config import job_config_to_toml
    from densetrain.data import build_data
    from densetrain.models import flops_per_token_palm, param_counts
    from densetrain.optim import build_lr_scheduler
    from densetrain.parallel.mesh import ParallelDims

    rank, world_size, local_rank = _init_distributed(job)
    device = resolve_device(job.training.device, local_rank=local_rank)
    dims = ParallelDims.from_config(job.parallel, world_size)
    job.validate(world_size=world_size, dp_size=dims.dp_size)
    mesh = dims.build_mesh(device.type)
    dp_rank = dims.dp_rank(mesh)
    data = build_data(job.data, dp_rank=dp_rank, dp_size=dims.dp_size)
    model_cfg = job.build_model_config(data.tokenizer.vocab_size)
    dims.validate_for_model(
        model_cfg, job.data.seq_len, job.training.global_batch_size,
        sequence_parallel=job.parallel.sequence_parallel,
    )
    seed_everything(job.training.seed)
    model = _build_model(job, dims, mesh, model_cfg, device)
    inner = unwrap_model(model)
    if job.training.init_from:
        _init_from(model, job.training.init_from)
    optimizer = _build_optimizer(model, dims, mesh, job)
    run_dir = Path(job.logging.run_dir)
    counts = param_counts(model_cfg)
    if job.logging.peak_tflops > 0:
        peak, peak_source = job.logging.peak_tflops * 1e12, "logging.peak_tflops"
    else:
        peak, peak_source = device_peak_flops(device, job.training.dtype)
    config_toml = job_config_to_toml(job)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _announce(config_toml, counts, world_size, device, peak, peak_source)
    return RunState(
        job=job, model=model, inner_model=inner, model_cfg=model_cfg, optimizer=optimizer,
        scheduler=build_lr_scheduler(
            # a wrapper such as ZeroOptimizer keeps its torch optimizer in ``.optimizer``
            optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer,
            job.schedule, job.training.steps,
        ),
        batch_schedule=job.batch_size_schedule(dims.dp_size), data=data, device=device,
        autocast=autocast_factory(device, job.training.dtype),
        loss_fn=make_loss_fn(model, job.training.loss_chunk_size),
        clip_grad_norm=_clip_fn(optimizer, dims, mesh), counters=TrainerCounters(), rank=rank,
        world_size=world_size, dp_size=dims.dp_size, run_dir=run_dir,
        checkpoint_dir=Path(job.checkpoint.dir) if job.checkpoint.dir else run_dir / "checkpoints",
        total_steps=job.training.steps,
        flops_per_token=flops_per_token_palm(model_cfg, job.data.seq_len),
        peak_flops=peak, peak_source=peak_source, params=counts.total,
        non_embedding_params=counts.non_embedding, config_toml=config_toml,
        **_cp_fields(dims, mesh), pp_group=_pp_group(dims, mesh),
    )


def _build_model(job: Any, dims: Any, mesh: Any, model_cfg: Any,
                 device: torch.device) -> torch.nn.Module:
    """The laid-out, initialised model: meta → ``parallelize()`` → ``to_empty`` → seeded init,
    or with pp > 1 this rank's pipeline stages (`train.pipelined`)."""
    from densetrain.models import Transformer

    if dims.pp > 1:
        from densetrain.train.pipelined import build_pipelined_model

        return build_pipelined_model(job, dims, mesh, model_cfg, device)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model = _parallelize(model, dims, mesh, job)
    model.to_empty(device=device)
    _init_weights(model, job.training.seed)
    return model


def _pp_group(dims: Any, mesh: Any) -> Any:
    pp_mesh = dims.submesh(mesh, "pp")
    return None if pp_mesh is None else pp_mesh.get_group()


def _cp_fields(dims: Any, mesh: Any) -> dict[str, Any]:
    """`RunState`'s context-parallel fields: degree, this rank's index and its group."""
    cp_mesh = dims.submesh(mesh, "cp")
    if cp_mesh is None:
        return {}
    return {"cp_size": dims.cp, "cp_rank": cp_mesh.get_local_rank(),
            "cp_group": cp_mesh.get_group()}
