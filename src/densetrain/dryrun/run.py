"""`dry_run_rank`: one rank of a job at its real world size, through the trainer's own code.

Runs, as ``rank`` of ``world_size`` on the fake process group (`dryrun.world`) and under
``FakeTensorMode`` (shapes, no storage): the job's validation with that world size, the mesh,
`build_model` (TP/SP, CP, activation checkpointing, FSDP/HSDP, pipeline stages, float8), the
trainer's optimizer (ZeRO-1/2 included), and one training step: the trainer's
``forward_backward``, gradient clipping and the optimizer step. `trace.StepTracer` records the
live bytes and collectives of the step.

What is traced and what is not (each report says so):
- traced: parameter, gradient and optimizer-state bytes of the rank (its tensors' storages), the
  peak of live bytes over the step, and every collective of the step;
- the step is two micro-batches of the real micro-batch size and sequence length (one if the
  rank's batch holds one; a pipeline runs its schedule's peak instead): a non-final one, as
  gradient accumulation runs it, then the final one; the rank's other micro-batches repeat the
  first's forward/backward. It is taken after the optimizer
  state exists (an update of zero gradients before it), so its peak is that of every later
  step;
- not traced: ``torch.compile`` (the eager modules run: compiled kernels fuse and so hold less),
  the data loader (a batch of the right shape stands in for the rank's first batch), the NaN
  guard's one host sync (fake tensors have no values), and the checkpoint writes: DCP's local
  save plan of the model and optimizer state is made (`_save_plan`), nothing is written.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from densetrain.config.job import JobConfig
from densetrain.dryrun.trace import Collective, StepTracer
from densetrain.dryrun.world import fake_world

NOT_TRACED = ("torch.compile (eager modules run)", "data loader (a batch of the right shape)",
              "NaN guard host sync", "checkpoint writes (the save plan is made, nothing written)")


@dataclass
class RankReport:
    """What one simulated rank holds and moves (bytes)."""

    rank: int
    world_size: int
    coordinates: dict[str, int]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    phase_peaks: dict[str, int]
    collectives: list[Collective]
    micro_batch_size: int
    seq_len: int
    microbatches: int
    local_params: int
    seconds: float
    traced_microbatches: int = 1
    fsdp_units: int = 0
    """FSDP units of the rank's pipeline stages (blocks and each stage's root; 0 without both)."""
    stage_chunks: int = 0
    """Pipeline stages this rank runs (virtual stages; 0 without pipeline parallelism)."""
    save_items: int = 0
    save_bytes: int = 0
    not_traced: tuple[str, ...] = NOT_TRACED
    notes: list[str] = field(default_factory=list)
    kinds_at_peak: dict[str, int] = field(default_factory=dict)
    """Live bytes at the peak by the operator that made them, in forward or backward (model
    states: the parameters, gradients and optimizer states alive before the step)."""


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state (moments; not the scalar step) and its own tensors
    (ZeRO's fp32 master chunks)."""
    out = [v for state in optimizer.state.values() for v in state.values()
           if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out + list(optimizer.optimizer_tensors())


def _group_names(pmesh) -> dict[str, str]:
    from densetrain.parallel.mesh import FLATTENED_AXES, MESH_AXES

    names: dict[str, str] = {}
    for axis in (*MESH_AXES, *FLATTENED_AXES):
        group = pmesh.group(axis)
        if group is not None:
            names.setdefault(group.group_name, axis)
    return names


def dry_run_ranks(job: JobConfig, world_size: int, ranks: list[int]) -> list[RankReport]:
    """`dry_run_rank` for each of ``ranks``, each in a fresh process (a process group, and the
    fake one too, is one per process). ``job`` is validated for ``world_size`` and resolved
    (`JobConfig.resolved`) by the caller, once, before any process starts."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    reports = []
    for rank in ranks:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            reports.append(pool.submit(_dry_run_resolved, job, world_size, rank).result())
    return reports


def dry_run_rank(job: JobConfig, world_size: int, rank: int) -> RankReport:
    """Build and step ``rank`` of ``world_size`` for ``job`` without allocating its tensors
    (``job`` is validated for ``world_size`` here, as the trainer validates it)."""
    job.validate(world_size=world_size)
    return _dry_run_resolved(job.resolved(world_size=world_size), world_size, rank)


def _dry_run_resolved(job: JobConfig, world_size: int, rank: int) -> RankReport:
    """`dry_run_rank` of a job already validated for ``world_size`` and resolved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from densetrain.parallel.mesh import ParallelDims
    from densetrain.train.setup import run_mesh

    start = time.perf_counter()
    dims = ParallelDims.from_config(job.parallel, world_size)
    with fake_world(world_size, rank):
        pmesh = run_mesh(job, dims, "cpu")  # real (small) rank tables, outside fake mode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        report = _traced_step(job, pmesh, rank, fake_mode)
    report.seconds = time.perf_counter() - start
    return report


def _traced_step(job: JobConfig, pmesh, rank: int, fake_mode) -> RankReport:
    """Build the model and optimizer of this rank and trace one step (its tensors fake)."""
    from densetrain.parallel.build import build_model
    from densetrain.train.setup import compute_dtype, run_layout

    dims, training, device = pmesh.dims, job.training, torch.device("cpu")
    model_cfg = job.build_model_config()
    pmesh = pmesh.with_layout(run_layout(job, model_cfg, dims.world_size), model_cfg)
    local_batch = dims.local_batch_size(training.global_batch_size)
    micro = training.micro_batch_size
    model = build_model(
        model_cfg, job.parallel, pmesh, device=device, seed=training.seed, compile=False,
        loss_chunk_size=training.loss_chunk_size, local_batch_size=local_batch,
        micro_batch_size=micro,
        float8_recipe=training.float8_recipe if training.dtype == "float8" else "",
        compute_dtype=compute_dtype(job),
        materialize=lambda: fake_mode,
    )
    with fake_mode:
        return _step(job, model, pmesh, rank)


def _optimizer_as_on_device(job: JobConfig, notes: list[str]) -> JobConfig:
    """The job whose optimizer the dry run builds: the one the job's device would run. On CUDA
    ``optim.fused = None`` picks torch's fused AdamW (`optim.optimizers`); the simulated rank's
    tensors are on the CPU, where it would pick the foreach kernel, whose whole-list
    temporaries (a copy of the rank's parameters) a CUDA run never allocates."""
    if job.optim.name != "adamw" or job.optim.fused is not None or job.training.device == "cpu":
        return job
    notes.append("optimizer: torch's fused AdamW, as optim.fused=None picks it on CUDA")
    return dataclasses.replace(job, optim=dataclasses.replace(job.optim, fused=True))


def _step(job: JobConfig, model, pmesh, rank: int) -> RankReport:
    from torch.distributed.fsdp import FSDPModule

    from densetrain.data.stream import Batch
    from densetrain.parallel.mesh import MESH_AXES
    from densetrain.train.device import autocast_factory
    from densetrain.train.setup import _bf16_if_float8, _build_optimizer

    dims, training, device = pmesh.dims, job.training, torch.device("cpu")
    model_cfg = job.build_model_config()
    local_batch = dims.local_batch_size(training.global_batch_size)
    micro = training.micro_batch_size
    optimizer = _build_optimizer(model, pmesh, _optimizer_as_on_device(job, notes := []))
    params = list(model.module.parameters())
    autocast = autocast_factory(device, _bf16_if_float8(training.dtype))
    # Two micro-batches when the step has them: the first runs as every non-final one does
    # (gradient accumulation), so what it leaves for the next (gradients) is in the peak.
    traced_micro = min(2, local_batch // micro)
    if dims.pp > 1:
        traced_micro = _static_pipeline(model, job, micro, autocast, notes)
    tokens = torch.randint(0, model_cfg.vocab_size,
                           (micro * traced_micro, job.data.seq_len + 1))
    batch = model.prepare_batch(Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:]), device)
    # The optimizer's state exists from the first update on: make it (an update of zero
    # gradients) so that the traced step is every later step, states held through its
    # forward/backward.
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    held = [*params, *_optimizer_tensors(optimizer)]
    tracer = StepTracer(_group_names(pmesh), baseline=held)
    with tracer:
        tracer.set_phase("forward+backward")
        if dims.pp > 1 and traced_micro == 0:
            for param in params:
                param.grad = torch.zeros_like(param)
        else:
            model.forward_backward(batch, micro_batch_size=micro, autocast=autocast)
        tracer.set_phase("clip")
        grad_clip = job.optim.grad_clip
        optimizer.clip_grad_norm_(grad_clip if grad_clip > 0 else float("inf"))
        tracer.set_phase("optimizer")
        optimizer.step()
    grads = [p.grad for p in params if p.grad is not None] + list(optimizer.grad_shards())
    chunks = list(model.pipeline.modules) if dims.pp > 1 else []
    units = sum(isinstance(sub, FSDPModule) for chunk in chunks for sub in chunk.modules())
    save_items, save_bytes = _save_plan(model, optimizer, is_coordinator=rank == 0, notes=notes)
    return RankReport(
        rank=rank, world_size=dims.world_size,
        coordinates={axis: pmesh.local_rank(axis) for axis in MESH_AXES
                     if dims.degree(axis) > 1},
        param_bytes=_storage_bytes(params), grad_bytes=_storage_bytes(grads),
        optimizer_bytes=_storage_bytes(_optimizer_tensors(optimizer)),
        peak_bytes=tracer.peak, phase_peaks=dict(tracer.phase_peaks),
        collectives=sorted(tracer.collectives.values(), key=lambda c: (c.group, c.kind)),
        micro_batch_size=micro, seq_len=job.data.seq_len,
        microbatches=local_batch // micro, traced_microbatches=max(traced_micro, 1),
        fsdp_units=units, stage_chunks=len(chunks),
        local_params=sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                         for p in params),
        seconds=0.0, notes=notes, save_items=save_items, save_bytes=save_bytes,
        kinds_at_peak=tracer.kinds_at_peak,
    )


def _static_pipeline(model, job: JobConfig, micro: int, autocast,
                     notes: list[str]) -> int:
    """Give this rank's pipeline a schedule that knows its stages' input and output shapes, over
    the microbatches that reach the schedule's peak. Returns how many it runs (0: the schedule
    cannot run here, and ``notes`` says why).

    torch's schedule settles at its first step, by p2p with the neighbouring stages, whether the
    stages' shapes are given (a vote) or must be inferred (an exchange of metadata); a fake peer
    answers neither. Given every stage's shapes (found here by running the stage's own forward
    on a fake input) each stage votes "static", so the vote is taken as its outcome and the
    schedule runs as in a real run: its sends and receives go to the fake process group. The
    vote is torch-internal (``_warmup_p2p``, ``_inference_mode``): a torch without it gets the
    gradients made instead, and the report says so.

    Memory: 1F1B holds at most ``pp`` microbatches in flight and the interleaved schedules at most
    ``2 * pp`` per stage, so the schedule runs ``min(m, pp + 1)`` (``min(m, 2 * pp + 2)``, the
    next count torch's interleaved rounds accept) of the step's ``m`` microbatches, reaching its
    steady state (in-flight microbatches beside the gradients accumulated since the first
    backward; the later ones repeat it); GPipe holds all ``m`` and runs them all. The trainer's
    stages make their receive buffers per transfer (`parallel.pipeline`): the microbatches not
    run hold none.
    """
    from torch.distributed.fsdp import FSDPModule

    from densetrain.parallel.parallelize import fsdp_gather_dtype
    from densetrain.parallel.pipeline import make_schedule

    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:
        InferenceMode = None  # noqa: N806
    pipeline, pmesh, cfg = model.pipeline, model.pmesh, job.parallel
    if InferenceMode is None or pipeline.loss_fn is None:
        notes.append(f"pipeline forward/backward not traced (torch {torch.__version__} has no "
                     "static stage vote): gradients made as zeros")
        return 0
    m, pp = pipeline.num_microbatches, pmesh.dims.pp
    in_flight = {"gpipe": m, "1f1b": pp}.get(cfg.pp_schedule, 2 * pp)
    # one more than the schedule holds in flight: its steady state, where a stage holds its
    # in-flight microbatches and the gradients accumulated since its first backward (FSDP keeps
    # them unsharded, in fp32, until the last microbatch's backward reduce-scatters them)
    count = min(m, in_flight + 1)
    if cfg.pp_schedule in ("interleaved_1f1b", "zero_bubble"):
        # torch's interleaved schedules run their microbatches in rounds of pp and refuse a
        # count that the rounds (count // pp of them) do not divide: 2pp + 1 never fits
        while count < m and count % max(1, count // pp):
            count += 1
    seq = job.data.seq_len // pmesh.dims.cp
    dim = job.build_model_config().dim

    # the residual stream's dtype: that of the parameters FSDP gathers (autocast leaves it)
    stream_dtype = fsdp_gather_dtype(cfg, torch.bfloat16 if job.training.dtype == "bf16"
                                     else None)

    def stage_io(stage_id: int, module) -> tuple:
        dtype = stream_dtype if isinstance(module, FSDPModule) and stream_dtype else next(
            module.parameters()).dtype
        if stage_id == 0:
            inputs = torch.zeros((micro, seq), dtype=torch.long)
        else:
            inputs = torch.zeros((micro, seq, dim), dtype=dtype)
        last = stage_id == pipeline.num_stages - 1
        # the last stage returns its loss (`Pipeline.step` hands it the targets)
        kwargs = {"targets_BS": torch.zeros((micro, seq), dtype=torch.long)} if last else {}
        with torch.no_grad(), autocast():
            outputs = module(inputs, **kwargs)
        for sub in module.modules():  # as torch's own shape inference leaves FSDP
            if isinstance(sub, FSDPModule):
                sub.reshard()
        # as in training: the received activations and the stage's output carry gradients
        if inputs.is_floating_point():
            inputs.requires_grad_(True)
        if last:
            return inputs, tuple(t.detach() for t in outputs)
        return inputs, outputs.detach().requires_grad_(True)

    schedule = make_schedule(pipeline.modules, pipeline.stage_ids, pipeline.num_stages, pmesh,
                             cfg, pipeline.loss_fn, microbatches=count,
                             device=torch.device("cpu"), stage_io=stage_io)

    def static_vote(stages, has_backward, p2p_done) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static_vote
    pipeline.schedule, pipeline.num_microbatches = schedule, count
    if count < m:
        notes.append(f"pipeline: {count} of the step's {m} microbatches traced (the schedule's "
                     "peak; the rest repeat its steady state, their receive buffers made per "
                     "transfer)")
    return count


def _save_plan(model, optimizer, *, is_coordinator: bool, notes: list[str]) -> tuple[int, int]:
    """This rank's part of a checkpoint save of the model and optimizer: DCP's own local save
    plan (``DefaultSavePlanner``, as ``dcp.save`` makes it) over the same Stateful parts a
    checkpoint holds. Returns its write items and the tensor bytes they cover (before the
    coordinator drops replicated copies, which needs every rank's plan). The small entries of a
    checkpoint (counters, schedules, data position, generators) are left out and noted."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from densetrain.checkpoint import ModelState

    try:
        tree = {"model": ModelState(model.module).state_dict(), "optim": optimizer.state_dict()}
        # The plan reads shapes and placements only; DTensor computes shard offsets with small
        # tensors of ints, which must be real to be read.
        with unset_fake_temporarily():
            planner = DefaultSavePlanner()
            planner.set_up_planner(tree, is_coordinator=is_coordinator)
            plan = planner.create_local_plan()
    except Exception as e:  # noqa: BLE001 - reported, never dropped silently
        notes.append(f"checkpoint save plan not traced: {type(e).__name__}: {e}"[:300])
        return 0, 0
    total = 0
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            sizes = item.tensor_data.chunk.sizes
            count = 1
            for size in sizes:
                count *= size
            total += count * item.tensor_data.properties.dtype.itemsize
    notes.append("save plan: model and optimizer only (counters, schedules, data position and "
                 "generators are a few KB)")
    return len(plan.items), total
