"""ZeRO-1 and ZeRO-2 (Rajbhandari et al. 2020, §5.1-5.2) over a data-parallel group.

Every rank keeps the full parameters. Each parameter is flattened, padded to a multiple of the
group size N and split into N equal chunks; rank r owns chunk r. The wrapped optimizer (AdamW or
any ``torch.optim`` class) steps only the owned chunks, so its states are 1/N per rank.

- ZeRO-1: gradients stay whole until ``step()``, which reduce-scatters them into the owned chunks.
- ZeRO-2: each gradient is reduce-scattered as soon as backward has accumulated it and the full
  gradient is freed, so only 1/N of the gradients is held.

After the local step the updated chunks are all-gathered into the full parameters. Per step a
rank sends a reduce-scatter of Ψ plus an all-gather of Ψ: 2Ψ, as in the paper's §7.

Hand-written because FSDP2 (``fully_shard``) always shards the parameters between steps (ZeRO-3
storage) and ``ZeroRedundancyOptimizer`` partitions whole parameters without sharding gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from densetrain.optim.interface import PER_RANK_KEY, TrainingOptimizer, per_rank_layout


class ZeroOptimizer(TrainingOptimizer):
    """A `TrainingOptimizer` over the rank's chunks of ``params``; ``step()`` keeps the full
    parameters in sync on every rank of ``group``. Gradients are averaged over the group.

    Its checkpoint state is this rank's chunks under a per-rank key, so it resumes on the same
    number of ranks only (``checkpoint_layout``)."""

    def __init__(
        self,
        param_groups: Iterable[dict] | Iterable[nn.Parameter],
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        group: dist.ProcessGroup,
        stage: int,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles zero_stage 1 or 2, got {stage}")
        groups = list(param_groups)
        if groups and isinstance(groups[0], torch.Tensor):
            groups = [{"params": groups}]
        self.group = group
        self.stage = stage
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._full: list[nn.Parameter] = []
        self._chunk: dict[nn.Parameter, nn.Parameter] = {}
        shard_groups = []
        for pg in groups:
            chunks = []
            for p in pg["params"]:
                chunk = nn.Parameter(self._owned_slice(p.detach()).clone())
                self._full.append(p)
                self._chunk[p] = chunk
                chunks.append(chunk)
            shard_groups.append({**pg, "params": chunks})
        self.torch_optimizer = optimizer_factory(shard_groups)
        self.checkpoint_layout = per_rank_layout(self.world)
        self._hooks = []
        if stage == 2:
            for p in self._full:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._scatter_grad))

    # ------------------------------------------------------------------ sharding helpers
    def _chunk_numel(self, p: torch.Tensor) -> int:
        return -(-p.numel() // self.world)

    def _padded_flat(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1)
        pad = self._chunk_numel(t) * self.world - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)) if pad else flat

    def _owned_slice(self, t: torch.Tensor) -> torch.Tensor:
        size = self._chunk_numel(t)
        return self._padded_flat(t)[self.rank * size : (self.rank + 1) * size]

    def _reduce_scatter_into_chunk(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        chunk = self._chunk[p]
        out = torch.empty_like(chunk)
        dist.reduce_scatter_single(out, self._padded_flat(grad).contiguous(), group=self.group)
        out.div_(self.world)
        chunk.grad = out if chunk.grad is None else chunk.grad.add_(out)

    def _scatter_grad(self, p: nn.Parameter) -> None:
        self._reduce_scatter_into_chunk(p, p.grad)
        p.grad = None

    # ------------------------------------------------------------------ optimizer API
    def grad_shards(self) -> list[torch.Tensor]:
        """Gradient chunks this rank holds (ZeRO-2 between backward and step)."""
        return [c.grad for c in self._chunk.values() if c.grad is not None]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The fp32 master chunks (part of the optimizer states in the paper's K=12 count)."""
        return list(self._chunk.values())

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the full gradients still pending (ZeRO-1) into the owned chunks."""
        for p in self._full:
            if p.grad is not None:
                self._reduce_scatter_into_chunk(p, p.grad)
                p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all chunks (all ranks); scale so it is at most ``max_norm``
        (0 measures only). Returns the norm before clipping, equal on every rank."""
        self.reduce_gradients()
        grads = self.grad_shards()
        if grads:
            local = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        else:
            local = torch.zeros(())
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            total = local
        else:
            total = local**norm_type
            dist.all_reduce(total, group=self.group)
            total = total ** (1.0 / norm_type)
        if max_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(
                list(self._chunk.values()), max_norm, total
            )
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter pending gradients (ZeRO-1), step the chunks, all-gather parameters."""
        self.reduce_gradients()
        self.torch_optimizer.step()
        for p in self._full:
            chunk = self._chunk[p]
            gathered = torch.empty(chunk.numel() * self.world, dtype=p.dtype, device=p.device)
            dist.all_gather_single(gathered, chunk.detach().contiguous(), group=self.group)
            p.copy_(gathered[: p.numel()].view_as(p))

    @torch.no_grad()
    def after_weights_loaded(self) -> None:
        """Copy this rank's chunks from the full parameters (after the model's weights were
        loaded, e.g. from a checkpoint), so the next ``step()`` starts from them."""
        for p in self._full:
            self._chunk[p].copy_(self._owned_slice(p.detach()))

    def zero_grad(self) -> None:
        """Drop the gradients of the full parameters and of the chunks."""
        for p in self._full:
            p.grad = None
        self.torch_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """``{"rank<r>": the wrapped optimizer's state dict}`` (this rank's chunks).

        A fresh optimizer first gets its per-chunk state (moments, step) from one update on zero
        gradients with the learning rate set to 0, so that a checkpoint load can fill it in
        place (AdamW's decoupled decay is scaled by lr, so 0 too)."""
        if not self.torch_optimizer.state:
            _create_state(self.torch_optimizer)
        return {f"{PER_RANK_KEY}{self.rank}": self.torch_optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict` on the same layout."""
        self.torch_optimizer.load_state_dict(state_dict[f"{PER_RANK_KEY}{self.rank}"])


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer) -> None:
    saved_lrs = []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
