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
- the step is one micro-batch of the real micro-batch size and sequence length (the rank's
  batch holds ``microbatches`` of them: the others repeat its forward/backward, and gradient
  accumulation adds no memory beyond the gradients already counted), taken after the optimizer
  state exists (an update of zero gradients before it), so its peak is that of every later
  step;
- not traced: ``torch.compile`` (the eager modules run: compiled kernels fuse and so hold less),
  the data loader (a batch of the right shape stands in for the rank's first batch), the NaN
  guard's one host sync (fake tensors have no values), and the checkpoint save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from densetrain.config.job import JobConfig
from densetrain.dryrun.trace import Collective, StepTracer
from densetrain.dryrun.world import fake_world

NOT_TRACED = ("torch.compile (eager modules run)", "data loader (a batch of the right shape)",
              "NaN guard host sync", "checkpoint save")


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
    not_traced: tuple[str, ...] = NOT_TRACED
    notes: list[str] = field(default_factory=list)


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
    fake one too, is one per process)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    reports = []
    for rank in ranks:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            reports.append(pool.submit(dry_run_rank, job, world_size, rank).result())
    return reports


def dry_run_rank(job: JobConfig, world_size: int, rank: int) -> RankReport:
    """Build and step ``rank`` of ``world_size`` for ``job`` without allocating its tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from densetrain.parallel.mesh import ParallelDims

    start = time.perf_counter()
    dims = ParallelDims.from_config(job.parallel, world_size)
    job.validate(world_size=dims.world_size, dp_size=dims.dp_size)
    with fake_world(world_size, rank):
        pmesh = dims.build_mesh("cpu")  # real (small) rank tables, outside fake mode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        report = _traced_step(job, pmesh, rank, fake_mode)
    report.seconds = time.perf_counter() - start
    return report


def _traced_step(job: JobConfig, pmesh, rank: int, fake_mode) -> RankReport:
    """Build the model and optimizer of this rank and trace one step (its tensors fake)."""
    from densetrain.parallel.build import build_model

    dims, training, device = pmesh.dims, job.training, torch.device("cpu")
    model_cfg = job.build_model_config()
    local_batch = dims.local_batch_size(training.global_batch_size)
    micro = training.micro_batch_size
    model = build_model(
        model_cfg, job.parallel, pmesh, device=device, seed=training.seed, compile=False,
        loss_chunk_size=training.loss_chunk_size, local_batch_size=local_batch,
        micro_batch_size=micro,
        float8_recipe=training.float8_recipe if training.dtype == "float8" else "",
        materialize=lambda: fake_mode,
    )
    with fake_mode:
        return _step(job, model, pmesh, rank)


def _step(job: JobConfig, model, pmesh, rank: int) -> RankReport:
    from densetrain.data.stream import Batch
    from densetrain.parallel.mesh import MESH_AXES
    from densetrain.train.device import autocast_factory
    from densetrain.train.setup import _bf16_if_float8, _build_optimizer

    dims, training, device = pmesh.dims, job.training, torch.device("cpu")
    model_cfg = job.build_model_config()
    local_batch = dims.local_batch_size(training.global_batch_size)
    micro = training.micro_batch_size
    optimizer = _build_optimizer(model, pmesh, job)
    params = list(model.module.parameters())
    tokens = torch.randint(0, model_cfg.vocab_size, (micro, job.data.seq_len + 1))
    batch = model.prepare_batch(Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:]), device)
    autocast = autocast_factory(device, _bf16_if_float8(training.dtype))
    # The optimizer's state exists from the first update on: make it (an update of zero
    # gradients) so that the traced step is every later step, states held through its
    # forward/backward.
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    held = [*params, *_optimizer_tensors(optimizer)]
    tracer = StepTracer(_group_names(pmesh), baseline=held)
    notes = []
    with tracer:
        tracer.set_phase("forward+backward")
        if dims.pp > 1:
            # torch's pipeline schedule agrees shapes and modes with its neighbours by p2p at
            # its first step, which no fake peer answers: the gradients are made instead.
            notes.append("pipeline forward/backward not traced: gradients made as zeros")
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
    return RankReport(
        rank=rank, world_size=dims.world_size,
        coordinates={axis: pmesh.local_rank(axis) for axis in MESH_AXES
                     if dims.degree(axis) > 1},
        param_bytes=_storage_bytes(params), grad_bytes=_storage_bytes(grads),
        optimizer_bytes=_storage_bytes(_optimizer_tensors(optimizer)),
        peak_bytes=tracer.peak, phase_peaks=dict(tracer.phase_peaks),
        collectives=sorted(tracer.collectives.values(), key=lambda c: (c.group, c.kind)),
        micro_batch_size=micro, seq_len=job.data.seq_len,
        microbatches=local_batch // micro,
        local_params=sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                         for p in params),
        seconds=0.0, notes=notes,
    )
