"""`parallelize()`: the one ordered entry point that lays a model out on a mesh.

Order (each step given only its own sub-mesh): tensor/sequence parallel → context parallel →
(pipeline split, done by ``parallel.pipeline`` which calls this per stage) → activation
checkpointing → compile → data parallel (FSDP2 ZeRO-3/HSDP, or DDP). ZeRO-1/2 keep the model
whole and shard the optimizer instead: build it with `build_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from densetrain.optim.interface import StandardOptimizer, TrainingOptimizer
from densetrain.parallel.checkpointing import apply_activation_checkpointing
from densetrain.parallel.compile import apply_compile
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.layout_check import (
    DataParallelKind,
    ResolvedLayout,
    layout_on_mesh,
    require,
)
from densetrain.parallel.mesh import ParallelDims, ParallelMesh


def data_parallel_kind(dims: ParallelDims, cfg: ParallelConfig) -> DataParallelKind:
    """How gradients are synchronised (`layout_check.DataParallelKind`) on ``dims`` with
    ``cfg``'s ZeRO stage, for a caller without a run's layout (`mesh_layout`).

    Raises ``UserError`` (the data-parallel rules of ``parallel.layout_check``) for a
    combination the trainer does not compose, so a direct caller cannot get one silently."""
    return _data_parallel_layout(dims, cfg).data_parallel


def mesh_layout(pmesh: ParallelMesh, cfg: ParallelConfig) -> ResolvedLayout:
    """The layout on ``pmesh``: the run's resolved layout (checked where the run was built,
    `ParallelMesh.with_layout`), or for a mesh handed over directly the layout of its degrees
    with ``cfg``'s options, its data-parallel rules checked (`data_parallel_kind`)."""
    if pmesh.layout is not None:
        return pmesh.layout
    return _data_parallel_layout(pmesh.dims, cfg)


def _data_parallel_layout(dims: ParallelDims, cfg: ParallelConfig) -> ResolvedLayout:
    layout = layout_on_mesh(dims, cfg)
    require(("ddp_without_tp_pp", "zero12_pure_dp"), layout)
    return layout


def parallelize(
    model: nn.Module, pmesh: ParallelMesh, cfg: ParallelConfig, *, compile: bool = False,
    gather_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Apply TP/SP → CP → AC → compile → FSDP/DDP to ``model`` (a Transformer or pipeline stage).

    Works in place and returns ``model``. On one process only activation checkpointing and
    compile apply. The data-parallel kind is the run's layout's (`mesh_layout`); a run's
    checked layout (``pmesh.layout``) spares the tensor-parallel guard. Weights are initialised
    afterwards with `init_weights`. ``gather_dtype``: the dtype FSDP gathers parameters in
    (None: their own, fp32; `fsdp_gather_dtype`).
    """
    dims = pmesh.dims
    if dims.tp > 1:
        from densetrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, pmesh.submesh("tp"), sequence_parallel=cfg.sequence_parallel,
                              layout=pmesh.layout)
    if dims.cp > 1:
        from densetrain.parallel.context import apply_context_parallel

        apply_context_parallel(model, pmesh.submesh("cp"))
    apply_activation_checkpointing(model, cfg.activation_checkpointing, every=cfg.ac_every,
                                   recompute=cfg.ac_recompute, tensor_parallel=dims.tp > 1,
                                   sequence_parallel=cfg.sequence_parallel, compiled=compile)
    if compile:
        apply_compile(model)
    kind = mesh_layout(pmesh, cfg).data_parallel
    single_rank = pmesh.param_shard_mesh() if gather_dtype is not None else None
    if single_rank is not None and kind in (DataParallelKind.NONE, DataParallelKind.DDP):
        from densetrain.parallel.fsdp import apply_fsdp

        apply_fsdp(model, single_rank, cpu_offload=cfg.cpu_offload, param_dtype=gather_dtype,
                   reshard_after_forward=cfg.pp_reshard_after_forward)
    elif kind in (DataParallelKind.FSDP, DataParallelKind.HSDP):
        from densetrain.parallel.fsdp import apply_fsdp

        shard_axis = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        if kind is DataParallelKind.HSDP:
            names = (["dp_replicate", pmesh.dim_name(shard_axis)] if dims.fsdp_size > 1
                     else ["dp_replicate"])
            dp_mesh = pmesh.device_mesh[tuple(names)]
        else:
            dp_mesh = pmesh.submesh(shard_axis)
        apply_fsdp(model, dp_mesh, cpu_offload=cfg.cpu_offload, param_dtype=gather_dtype,
                   reshard_after_forward=cfg.pp_reshard_after_forward)
    elif kind is DataParallelKind.DDP:
        from densetrain.parallel.ddp import apply_ddp

        apply_ddp(model, pmesh.submesh("dp_replicate"))
    return model


def fsdp_gather_dtype(cfg: ParallelConfig, compute_dtype: torch.dtype | None
                      ) -> torch.dtype | None:
    """The dtype FSDP gathers parameters in for a run computing in ``compute_dtype`` (autocast's
    dtype; None or fp32: no autocast): that dtype under ``param_dtype = "compute"`` (each
    matmul would cast the fp32 parameter to it anyway, so only the all-gather and the gathered
    copy shrink), else None (fp32)."""
    if cfg.param_dtype != "compute" or compute_dtype in (None, torch.float32):
        return None
    return compute_dtype


def single_rank_fsdp(cfg: ParallelConfig, dims: ParallelDims,
                     compute_dtype: torch.dtype | None) -> bool:
    """Whether a layout without sharded data parallelism computes in bf16 copies of fp32
    master weights through FSDP2 over a one-rank shard group (``parallel.param_dtype``).

    Tensor or pipeline parallel alone and plain data parallel (the ``none`` and ``ddp``
    data-parallel kinds on more than one rank) under a bf16 ``compute_dtype``: FSDP2's mixed
    precision is the library's bf16-compute/fp32-master split (the sharded fp32 parameter is
    the optimizer's, the unsharded copy is made in bf16 and freed after use, gradients are
    reduced and accumulated in fp32), and on a one-rank group its all-gather and
    reduce-scatter are local copies. So the residual stream, the tensor-parallel collectives
    and the pipeline sends are bf16 (with fp32 parameters under autocast they are fp32),
    and plain data parallel becomes HSDP over one-rank shards: an fp32 all-reduce over the
    replicas, as DDP's. One process has no process group and keeps autocast."""
    kind = DataParallelKind.of(dp_replicate=dims.dp_replicate, fsdp_size=dims.fsdp_size,
                               zero_stage=cfg.zero_stage)
    return (dims.world_size > 1 and kind in (DataParallelKind.NONE, DataParallelKind.DDP)
            and fsdp_gather_dtype(cfg, compute_dtype) is not None)


def build_optimizer(
    module: nn.Module,
    pmesh: ParallelMesh,
    cfg: ParallelConfig,
    optimizer_factory: Callable[[list], torch.optim.Optimizer],
    param_groups: list | None = None,
) -> TrainingOptimizer:
    """The `TrainingOptimizer` of a parallelized ``module``: ``optimizer_factory(param_groups)``
    over its parameters, or for ZeRO-1/2 (the data-parallel kind and ZeRO stage of the run's
    layout, `mesh_layout`) a ``ZeroOptimizer`` that runs it on this rank's chunks. Pipeline
    stages sum their gradient norms over the pp group."""
    groups = param_groups if param_groups is not None else list(module.parameters())
    layout = mesh_layout(pmesh, cfg)
    if layout.data_parallel is DataParallelKind.ZERO12:
        from densetrain.parallel.zero import ZeroOptimizer

        return ZeroOptimizer(groups, optimizer_factory, group=pmesh.group("dp_shard"),
                             stage=layout.zero_stage)
    groups = split_by_tensor_kind(groups)
    return StandardOptimizer(module, optimizer_factory(groups), norm_group=pmesh.group("pp"))


def split_by_tensor_kind(param_groups: list) -> list:
    """Each param group split in two when it mixes DTensor and plain parameters (tensor parallel
    without sequence parallel leaves the norm weights plain): torch's foreach optimizer kernels
    refuse a list that mixes them. Group options are kept; an unmixed group is unchanged."""
    from torch.distributed.tensor import DTensor

    groups = param_groups
    if groups and isinstance(groups[0], torch.Tensor):
        groups = [{"params": list(groups)}]
    out = []
    for group in groups:
        params = list(group["params"])
        sharded = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        if sharded and plain:
            out.extend([{**group, "params": sharded}, {**group, "params": plain}])
        else:
            out.append({**group, "params": params})
    return out


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Run the model's seeded ``init_weights`` on a parallelized (DTensor) model.

    Each rank draws only the values it holds (a value depends only on seed, parameter name and
    its index in the full tensor: `models.init`), so time and memory follow the rank's share,
    not the model, and every layout holds the bits one process would.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        model.init_weights(seed=seed, write=write_local_shard)


def write_local_shard(param: torch.Tensor, draw) -> None:
    """Store into ``param`` the values of this rank's part of it: the whole tensor when it is
    plain or replicated, else its DTensor shard (no communication)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.tensor import DTensor

    if is_fake(param):  # a dry run's fake tensor holds no values: nothing to draw
        return
    if not isinstance(param, DTensor):
        param.copy_(draw(None))
        return
    local = param.to_local()
    index = local_index(param)
    local.copy_(draw(index).to(device=local.device, dtype=local.dtype).view(local.shape))


def local_index(param) -> list[torch.Tensor | None]:
    """Per dimension, the positions in the full tensor of the elements this rank's shard of the
    DTensor ``param`` holds (None: all of that dimension), in local order.

    Follows the placements left to right as DTensor does (`Shard`: ``torch.chunk`` semantics,
    uneven last chunks included; ``_StridedShard``, which FSDP2 puts over a tensor-parallel
    shard of the same dimension: the strided positions). Written out here because DTensor's
    public helper returns only the first offset of each dimension, which does not describe a
    strided shard.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    index: list[torch.Tensor | None] = [None] * param.dim()
    for mesh_dim, placement in enumerate(param.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        dim = placement.dim
        current = index[dim] if index[dim] is not None else torch.arange(param.shape[dim])
        chunks, rank = mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):
            _, offsets = placement.local_shard_size_and_offset(
                len(current), chunks, rank, _StridedShardOffsetMode.ALL)
            picked = torch.tensor(offsets, dtype=torch.long)
        else:
            size, offset = Shard.local_shard_size_and_offset(len(current), chunks, rank)
            picked = torch.arange(offset, offset + size)
        index[dim] = current[picked]
    return index
