"""`ParallelDims`: the degrees of one layout, validated, and the one device mesh built from them.

Mesh axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp`` (tp innermost so that its
ranks are neighbours: on GPUs, the same node and NVLink). Only axes of degree > 1 are created;
flattened axes are added for the groups several steps share:

- ``dp``          = dp_replicate × dp_shard: ranks that see different data.
- ``dp_shard_cp`` = dp_shard × cp: the group FSDP shards parameters over (cp ranks hold the same
  weights, so they shard them too, as Llama 3 does).
- ``dp_cp``       = dp_replicate × dp_shard × cp: the group the loss is averaged over.

`ParallelDims.build_mesh` returns the `ParallelMesh` (degrees + ``DeviceMesh``) that every parallel
step receives; its `submesh(name)` is the named (possibly flattened) sub-mesh, or None when its
degree is 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from densetrain.errors import UserError
from densetrain.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from densetrain.parallel.layout_check import ResolvedLayout

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_AXES = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """Concrete degrees of a layout whose product is the world size (``dp_shard`` resolved)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` and check that the degrees multiply to ``world_size``.

        ``cfg`` itself is not validated again: `ParallelConfig.__post_init__` checked it when it
        was built, and a job's section is checked by the job's validation
        (`densetrain.config.rules.validate_job`), which the trainer runs before this.
        """
        from densetrain.parallel.layout_check import resolve_dp_shard

        dp_shard, problem = resolve_dp_shard(cfg, world_size)
        if problem:
            raise UserError(problem)
        return cls(
            dp_replicate=cfg.dp_replicate,
            dp_shard=dp_shard,
            cp=cfg.cp,
            tp=cfg.tp,
            pp=cfg.pp,
            world_size=world_size,
        )

    # ------------------------------------------------------------------ derived degrees
    @property
    def dp_size(self) -> int:
        """Data-parallel degree: ranks that read different batches (dp_replicate × dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that FSDP shards parameters over (dp_shard × cp)."""
        return self.dp_shard * self.cp

    def degree(self, name: str) -> int:
        """Degree of a mesh axis or flattened axis by name."""
        if name in MESH_AXES:
            return getattr(self, name)
        if name in FLATTENED_AXES:
            return math.prod(getattr(self, a) for a in FLATTENED_AXES[name])
        allowed = MESH_AXES + tuple(FLATTENED_AXES)
        raise UserError(f"unknown mesh axis {name!r}; allowed: {allowed}")

    @property
    def is_single_process(self) -> bool:
        """True when every degree is 1 (no mesh, no collectives)."""
        return self.world_size == 1

    # ------------------------------------------------------------------ mesh
    def active_axes(self) -> list[str]:
        """Mesh axes of degree > 1, outermost first."""
        return [a for a in MESH_AXES if getattr(self, a) > 1]

    def build_mesh(self, device_type: str, *, single_rank_shard: bool = False) -> ParallelMesh:
        """The `ParallelMesh` of this layout: the ``DeviceMesh`` over the active axes (plus
        flattened ones), or none on one rank.

        ``single_rank_shard`` adds a ``dp_shard`` dimension of size 1 to a mesh without one,
        over which FSDP2 keeps fp32 master weights and computes with their bf16 copies
        (`parallelize.single_rank_fsdp`); `submesh` and `group` still see degree 1 there. The
        default process group must be initialised (see ``parallel.distributed``).
        """
        from torch.distributed.device_mesh import init_device_mesh

        axes = self.active_axes()
        if not axes:
            return ParallelMesh(dims=self, device_mesh=None)
        if single_rank_shard and "dp_shard" not in axes:
            axes = [a for a in MESH_AXES if a in axes or a == "dp_shard"]
        mesh = init_device_mesh(
            device_type, tuple(getattr(self, a) for a in axes), mesh_dim_names=tuple(axes)
        )
        for flat_name, parts in FLATTENED_AXES.items():
            present = tuple(a for a in parts if getattr(self, a) > 1)
            if len(present) > 1:
                mesh[present]._flatten(flat_name)
        return ParallelMesh(dims=self, device_mesh=mesh)

    def local_batch_size(self, global_batch_size: int) -> int:
        """Sequences per data-parallel rank per step."""
        return global_batch_size // self.dp_size


@dataclass(frozen=True)
class ParallelMesh:
    """One layout on the real ranks: its degrees (``dims``) and the ``DeviceMesh`` built from
    them (None on one process). Every parallel step receives this one object and takes its own
    named sub-mesh from it."""

    dims: ParallelDims
    device_mesh: Any
    layout: ResolvedLayout | None = None
    """The run's resolved layout, checked against its model (`with_layout`), which the builders
    read; None for a mesh handed to a builder directly (each builder then checks its part)."""

    def with_layout(self, layout: ResolvedLayout, model_cfg: Any) -> ParallelMesh:
        """This mesh carrying ``layout`` (of these degrees) once `layout_check.layout_reasons`
        finds nothing against it with ``model_cfg``; ``UserError`` with the first reason
        otherwise. The one check of a run's layout: the builders that read it check nothing."""
        from densetrain.parallel.layout_check import layout_reasons

        degrees = tuple(getattr(layout, a) for a in (*MESH_AXES, "world_size"))
        if degrees != tuple(getattr(self.dims, a) for a in (*MESH_AXES, "world_size")):
            raise ValueError(f"the layout's degrees {degrees} are not this mesh's {self.dims}")
        reasons = layout_reasons(layout, model_cfg)
        if reasons:
            raise UserError(reasons[0])
        return replace(self, layout=layout)

    def dim_name(self, name: str) -> str:
        """The mesh dimension that axis ``name`` is: a flattened axis of which only one part
        has degree > 1 is that part's own dimension (``dp_shard_cp`` with ``dp_shard`` = 1 is
        ``cp``); `build_mesh` flattens only axes of two or more parts."""
        if name in MESH_AXES:
            return name
        present = [a for a in FLATTENED_AXES[name] if getattr(self.dims, a) > 1]
        return present[0] if len(present) == 1 else name

    def param_shard_mesh(self):
        """The mesh FSDP shards parameters over when sharded data parallelism is off but the
        mesh has the size-1 ``dp_shard`` dimension (`ParallelDims.build_mesh`): that dimension,
        with ``dp_replicate`` before it when plain data parallel replicates (HSDP over one-rank
        shards); None without it."""
        if (self.device_mesh is None or self.dims.dp_shard != 1
                or "dp_shard" not in (self.device_mesh.mesh_dim_names or ())):
            return None
        if self.dims.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    def submesh(self, name: str):
        """The sub-mesh for axis ``name`` (a mesh or flattened axis), or None if its degree is 1."""
        if self.device_mesh is None or self.dims.degree(name) == 1:
            return None
        return self.device_mesh[self.dim_name(name)]

    def group(self, name: str):
        """The process group of axis ``name``, or None when its degree is 1."""
        sub = self.submesh(name)
        return None if sub is None else sub.get_group()

    def local_rank(self, name: str) -> int:
        """This rank's index along axis ``name`` (0 when its degree is 1)."""
        sub = self.submesh(name)
        return 0 if sub is None else sub.get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which slice of the batch it reads)."""
        return self.local_rank("dp")
