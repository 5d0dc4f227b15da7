"""Build a run from a `JobConfig`: process group, mesh, data, the laid-out model, optimizer,
schedules. Each builder gets its own sub-config; the layout itself is built by
``parallel.build.build_model`` (meta → parallelize → materialise → seeded init, pipeline too).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

from densetrain.checkpoint import (
    CheckpointError,
    CheckpointSession,
    ModelState,
    TrainerCounters,
    load_model_weights,
)
from densetrain.checkpoint.objstore import check_reachable, checkpoint_location, is_remote
from densetrain.config.job import JobConfig
from densetrain.errors import DamagedFileError, UserError, describe_error
from densetrain.models.config import ModelConfig
from densetrain.models.sizing import ParamCounts
from densetrain.optim.interface import TrainingOptimizer
from densetrain.parallel.compile import check_cpu_compiler
from densetrain.parallel.layout_check import ResolvedLayout
from densetrain.parallel.mesh import ParallelDims, ParallelMesh
from densetrain.parallel.model import LaidOutModel
from densetrain.train.device import autocast_factory, resolve_device, tune_cpu_threads
from densetrain.train.fault_record import FaultRecord
from densetrain.train.host_malloc import tune_host_allocator
from densetrain.train.metrics import (
    cpu_bf16_warning,
    float8_emulation_warning,
    run_peak,
)
from densetrain.train.state import ModelSizes, Progress, RunParts, RunSettings


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _init_distributed(job: JobConfig) -> tuple[int, int, int]:
    from densetrain.parallel.distributed import init_distributed

    device_type = resolve_device(job.training.device).type
    info = init_distributed(
        timeout_s=job.parallel.collective_timeout_s,
        device_type="cuda" if device_type == "cuda" else "cpu",
    )
    return info.rank, info.world_size, info.local_rank


def compute_dtype(job: JobConfig) -> torch.dtype | None:
    """Autocast's dtype for the job (bf16, or None: none)."""
    return torch.bfloat16 if job.training.dtype == "bf16" else None


def run_mesh(job: JobConfig, dims: ParallelDims, device_type: str) -> ParallelMesh:
    """The mesh of a job's degrees, with the size-1 ``dp_shard`` dimension where its bf16
    parameters run FSDP over one-rank shards (`parallelize.single_rank_fsdp`): what the run and
    its dry run build."""
    from densetrain.parallel.parallelize import single_rank_fsdp

    return dims.build_mesh(device_type, single_rank_shard=single_rank_fsdp(
        job.parallel, dims, compute_dtype(job)))


def run_layout(job: JobConfig, model_cfg: ModelConfig, world_size: int) -> ResolvedLayout:
    """The `ResolvedLayout` of a (checked, resolved) job training ``model_cfg`` on
    ``world_size`` ranks: what the run and its dry run attach to their mesh."""
    from densetrain.parallel.config import computes_in_bf16_params
    from densetrain.parallel.layout_check import resolve_layout

    training = job.training
    return resolve_layout(
        job.parallel, model_cfg, world_size=world_size, seq_len=job.data.seq_len,
        global_batch_size=training.global_batch_size,
        micro_batch_size=training.micro_batch_size, compile=training.compile,
        document_masking=job.data.document_masking,
        batch_ramp=job.schedule.batch_ramp_start > 0, float8=training.dtype == "float8",
        bf16_params=computes_in_bf16_params(job.parallel, training.dtype))


def _build_optimizer(model: LaidOutModel, pmesh: ParallelMesh, job: JobConfig
                     ) -> TrainingOptimizer:
    """The job's optimizer over decay/no-decay groups (ZeRO-1/2 shards its state)."""
    from densetrain.optim import build_optimizer
    from densetrain.optim.param_groups import param_groups
    from densetrain.parallel.parallelize import build_optimizer as build_parallel_optimizer

    groups = param_groups(model.module, weight_decay=job.optim.weight_decay,
                          decay_embeddings=job.optim.decay_embeddings)
    return build_parallel_optimizer(model.module, pmesh, job.parallel,
                                    lambda g: build_optimizer(g, job.optim), groups)


INIT_SOURCES = ("a densetrain model directory (written by `densetrain convert --from-hf`), a "
                "Hugging Face model directory (config.json with model_type), or a training "
                "checkpoint (step-N, a directory of them, or a run directory)")
"""What ``training.init_from`` accepts, for its messages."""


def init_from(model: torch.nn.Module, source: str) -> None:
    """Initial weights from a densetrain model directory, a Hugging Face model directory or a
    densetrain training checkpoint (told apart as ``densetrain eval`` does: a ``config.json``
    with or without ``model_type``, else the newest training checkpoint there that verifies
    against its manifest, `checkpoint.load_model_weights`). Every bad source is a
    ``UserError`` (``DamagedFileError`` for damaged files) naming ``training.init_from`` and
    the path."""
    from densetrain.models.hf.native import is_model_dir

    field = f"training.init_from={source!r}"
    remote = is_remote(source)  # a training checkpoint on an object store (objstore.py)
    path: Path | str = source.rstrip("/") if remote else Path(source)
    if remote:
        try:
            check_reachable(source)
        except UserError as err:
            raise UserError(f"{field}: {err}") from None
    elif not path.exists():
        raise UserError(f"{field} does not exist; give {INIT_SOURCES}")
    has_config = not remote and (path / "config.json").is_file()
    try:
        if has_config:
            _init_from_model_dir(model, path, native=is_model_dir(path))
        elif load_model_weights(path, model) is None:
            raise UserError(f"{path} is not a model directory (no config.json) and holds no "
                            f"training checkpoint; give {INIT_SOURCES}")
    except (CheckpointError, ValueError, OSError) as err:  # UserError, DamagedFileError too
        kind = DamagedFileError if isinstance(err, DamagedFileError) else UserError
        raise kind(f"{field}: {describe_error(err)}") from err


def _init_from_model_dir(model: torch.nn.Module, path: Path, *, native: bool) -> None:
    """Copy the weights of a densetrain (``native``) or Hugging Face model directory into
    ``model``, every tensor's name and shape checked first."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from densetrain.models.hf import load_hf, load_model

    loaded = load_model(path, dtype=torch.float32) if native else load_hf(path,
                                                                            dtype=torch.float32)
    source = loaded.state_dict()
    kind = "densetrain model" if native else "Hugging Face model"
    for name, value in get_model_state_dict(model).items():
        if name not in source:
            raise UserError(f"{path} ({kind}) has no tensor {name!r}; set [model] to its "
                            "architecture")
        if tuple(source[name].shape) != tuple(value.shape):
            raise UserError(
                f"{path} ({kind}): tensor {name!r} has shape {tuple(source[name].shape)} but "
                f"the job's model expects {tuple(value.shape)}; set [model] to the "
                "checkpoint's architecture"
            )
    set_model_state_dict(model, source, options=StateDictOptions(full_state_dict=True))


def _announce(config_toml: str, counts: ParamCounts, world_size: int, device: torch.device,
              peak: float, peak_source: str) -> None:
    print(f"# resolved config\n{config_toml}", file=sys.stderr)
    print(
        f"model: {counts.total / 1e6:.2f}M parameters ({counts.non_embedding / 1e6:.2f}M "
        f"non-embedding), {world_size} process(es) on {device}, peak {peak / 1e12:.3g} "
        f"TFLOP/s per device, {peak_source}",
        file=sys.stderr,
    )


def _bf16_if_float8(dtype: str) -> str:
    """float8 runs everything but the blocks' linear layers under bf16 autocast, and their MFU
    is stated against the bf16 peak (the convention of float8 training reports)."""
    return "bf16" if dtype == "float8" else dtype


def build_run(job: JobConfig) -> tuple[RunParts, Progress]:
    """Everything the loop needs, built from ``job`` (validated here with the real world
    size), and fresh progress counters."""
    from densetrain.config import job_config_to_toml
    from densetrain.data import build_data
    from densetrain.models import flops_per_token_palm, param_counts
    from densetrain.optim import build_lr_scheduler
    from densetrain.parallel.build import build_model
    from densetrain.parallel.distributed import env_world_size
    # The run's one check with the real world size (the layout rules of
    # parallel.layout_check included), before any process group; the parts are built from the
    # resolved copy (derived fields filled), which is also the config saved for a resume.
    world_size = env_world_size()
    job = job.checked(world_size=world_size)
    dims = ParallelDims.from_config(job.parallel, world_size)
    rank, world_size, local_rank = _init_distributed(job)
    assert world_size == dims.world_size, "the process group disagrees with WORLD_SIZE"
    device = resolve_device(job.training.device, local_rank=local_rank)
    if job.training.compile and device.type == "cpu":
        check_cpu_compiler()
    allocator_note = tune_host_allocator(job.training.host_allocator, device.type)
    threads_note = tune_cpu_threads(device.type)  # before the peak probe, which uses them
    pmesh = run_mesh(job, dims, device.type)
    data = build_data(job.data, dp_rank=pmesh.dp_rank, dp_size=dims.dp_size)
    model_cfg: ModelConfig = job.build_model_config(data.tokenizer.vocab_size)
    seed_everything(job.training.seed)
    training = job.training
    # The run's one resolved layout, checked with the real model; every builder reads it.
    pmesh = pmesh.with_layout(run_layout(job, model_cfg, dims.world_size), model_cfg)
    model = build_model(
        model_cfg, job.parallel, pmesh, device=device, seed=training.seed,
        compile=training.compile, loss_chunk_size=training.loss_chunk_size,
        float8_recipe=training.float8_recipe if training.dtype == "float8" else "",
        compute_dtype=compute_dtype(job),
    )
    if training.init_from:
        init_from(model.module, training.init_from)
    optimizer = _build_optimizer(model, pmesh, job)
    run_dir = Path(job.logging.run_dir)
    counts = param_counts(model_cfg)
    peak = run_peak(device, _bf16_if_float8(training.dtype), job.logging.peak_tflops)
    config_toml = job_config_to_toml(job)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _announce(config_toml, counts, world_size, device, peak.flops, peak.source)
        print(allocator_note, file=sys.stderr, flush=True)
        if threads_note is not None:
            print(threads_note, file=sys.stderr, flush=True)
        for warning in (cpu_bf16_warning(device, training.dtype),
                        float8_emulation_warning(device, training.dtype)):
            if warning is not None:
                print(warning, file=sys.stderr, flush=True)
    if job.checkpoint.enabled and is_remote(job.checkpoint.dir):
        check_reachable(job.checkpoint.dir)  # a missing bucket is named before any step
    scheduler = build_lr_scheduler(optimizer.torch_optimizer, job.schedule, training.steps)
    batch_schedule = job.batch_size_schedule(dims.dp_size)
    checkpoint_dir = (checkpoint_location(job.checkpoint.dir) if job.checkpoint.dir
                      else run_dir / "checkpoints")
    progress = TrainerCounters()
    # The run's checkpoints over the parts just built (schema, saves, resume, rollback); its
    # fault record is the one the FaultGuard fills (train/faults.py).
    checkpoints = CheckpointSession(
        model=ModelState(model.module), optimizer=optimizer, lr_schedule=scheduler,
        batch_schedule=batch_schedule, data=data.train, progress=progress,
        faults=FaultRecord(), directory=checkpoint_dir, run_dir=run_dir,
        config_toml=config_toml, keep_last=job.checkpoint.keep_last,
        async_save=job.checkpoint.async_save, timeout_s=job.parallel.collective_timeout_s,
        is_main=rank == 0, after_load=optimizer.after_weights_loaded, device=device)
    parts = RunParts(
        model=model, model_cfg=model_cfg, optimizer=optimizer,
        scheduler=scheduler, batch_schedule=batch_schedule, data=data, device=device,
        autocast=autocast_factory(device, _bf16_if_float8(training.dtype)), pmesh=pmesh,
        settings=RunSettings(
            steps=training.steps, global_batch_size=training.global_batch_size,
            micro_batch_size=training.micro_batch_size, seq_len=job.data.seq_len,
            grad_clip=job.optim.grad_clip, nan_policy=training.nan_policy,
            config_toml=config_toml),
        rank=rank, world_size=world_size, run_dir=run_dir, checkpoint_dir=checkpoint_dir,
        sizes=ModelSizes(params=counts.total, non_embedding_params=counts.non_embedding,
                         flops_per_token=flops_per_token_palm(model_cfg, job.data.seq_len)),
        peak=peak, checkpoints=checkpoints,
    )
    return parts, progress
