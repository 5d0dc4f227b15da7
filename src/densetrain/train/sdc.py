"""Silent data corruption: a periodic bit-exact comparison of the replicated training state.

Gemini (Gemini Team, 2023, §"Training infrastructure") met silent data corruption on its
accelerators every week or two and found it by comparing replicated computation. Data-parallel
replicas must hold bit-identical parameters (and, under DDP and HSDP, optimizer states): a
flipped bit in one replica's memory, or a miscomputed update, shows as a replica that differs.
Every ``faults.sdc_check_interval`` steps each rank reduces every tensor to one integer checksum
(the sum of its bits read as integers of its element size, accumulated in int64: a single
flipped bit changes it by ±2^k, never by 0), the replicas all-gather the vector of checksums,
and the tensors and ranks that disagree with the majority are named.

Which ranks are replicas follows the data-parallel kind of the run's resolved layout
(``ResolvedLayout.data_parallel``, through ``parallel.parallelize.mesh_layout``): the
``dp_replicate`` group under DDP and HSDP (same shards), the ``dp_shard`` group under ZeRO-1/2
(parameters only; the optimizer state is sharded there). FSDP alone and one process have no
replicas, so there is nothing to compare.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.distributed as dist

from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.mesh import ParallelMesh
from densetrain.parallel.parallelize import mesh_layout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 sum of ``tensor``'s elements read bit for bit as integers (on its device)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local = local.detach().contiguous()
    return local.view(_INT_OF_SIZE[local.element_size()]).sum(dtype=torch.int64)


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Names and the stacked checksums of ``named`` tensors."""
    names, sums = [], []
    for name, tensor in named:
        names.append(name)
        sums.append(checksum(tensor))
    return names, torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def replica_axis(pmesh: ParallelMesh, cfg: ParallelConfig) -> str | None:
    """The mesh axis whose ranks hold identical parameters in the layout on ``pmesh`` (the
    run's resolved layout; ``cfg``'s options on a mesh without one), or None."""
    return mesh_layout(pmesh, cfg).data_parallel.replica_axis


def disagreeing(values: list[int]) -> list[int]:
    """Indices of ``values`` that differ from the strict majority; all of them when no value
    has a strict majority (two replicas that differ cannot say which one is wrong)."""
    counts = Counter(values)
    value, count = counts.most_common(1)[0]
    if count == len(values):
        return []
    if 2 * count <= len(values):
        return list(range(len(values)))
    return [i for i, v in enumerate(values) if v != value]


class ReplicaCheck:
    """Compares this rank's parameters (and optionally optimizer states) with its replicas'.

    ``axis`` is the mesh axis whose ranks hold the same values (None: no replicas)."""

    def __init__(self, pmesh: ParallelMesh, axis: str | None, *, optimizer_states: bool
                 ) -> None:
        self.group = pmesh.group(axis) if axis is not None else None
        self.axis = axis
        self.optimizer_states = optimizer_states and axis != "dp_shard"  # ZeRO shards them
        self.global_ranks = (dist.get_process_group_ranks(self.group)
                             if self.group is not None else [])

    @property
    def active(self) -> bool:
        """True when there are replicas to compare."""
        return self.group is not None

    def mismatch(self, module: torch.nn.Module, optimizer_state: dict | None) -> str | None:
        """A message naming the tensors and global ranks that disagree, or None. Collective
        over the replica group."""
        named = list(module.named_parameters())
        if self.optimizer_states and optimizer_state is not None:
            names_of = {id(p): n for n, p in named}
            for param, state in optimizer_state.items():
                for key, value in sorted(state.items()):
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        named.append((f"optim.{names_of.get(id(param), '?')}.{key}", value))
        names, local = checksums(named)
        gathered = [torch.empty_like(local) for _ in self.global_ranks]
        dist.all_gather(gathered, local, group=self.group)
        table = torch.stack(gathered).cpu()  # [replica, tensor]; the check's one host sync
        bad = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
        if not bad:
            return None
        ranks = sorted({self.global_ranks[i] for t in bad
                        for i in disagreeing(table[:, t].tolist())})
        shown = ", ".join(names[t] for t in bad[:5]) + (" ..." if len(bad) > 5 else "")
        return (f"silent data corruption: the {self.axis} replicas (global ranks "
                f"{self.global_ranks}) disagree bit for bit on {len(bad)} tensor(s) ({shown}); "
                f"rank(s) {ranks} differ from the majority")
