"""`TrainingOptimizer`: the one optimizer interface the trainer, the LR schedule, clipping and
checkpoints use, whatever the layout.

Two implementations: `StandardOptimizer` (a ``torch.optim`` optimizer over the model's own
parameters, plain, DTensor-sharded by FSDP2/TP, or a pipeline stage's) here, and the ZeRO-1/2
optimizer of ``densetrain.parallel.zero`` (this rank's chunks of every parameter). Callers never
ask which one they hold: each says how to clip its gradients, how its state goes into a
checkpoint, and what to do after the model's weights were loaded.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PER_RANK_KEY = "rank"
"""Prefix of the per-rank entries (``rank0``, ``rank1``...) of a layout-dependent state."""

LAYOUT_INDEPENDENT = "layout-independent (keyed by parameter name)"


def per_rank_layout(world_size: int) -> str:
    """The checkpoint layout of an optimizer state saved per rank on ``world_size`` ranks."""
    return f"per rank (ZeRO-1/2) on world size {world_size}"


def layout_of_saved_keys(keys: Iterable[str]) -> str:
    """The layout (`LAYOUT_INDEPENDENT` or `per_rank_layout`) of a saved optimizer state whose
    top-level keys are ``keys`` (the part of each DCP key after ``optim.``)."""
    ranks = {k.split(".", 1)[0] for k in keys if k.startswith(PER_RANK_KEY)
             and k.split(".", 1)[0][len(PER_RANK_KEY):].isdigit()}
    return per_rank_layout(len(ranks)) if ranks else LAYOUT_INDEPENDENT


class TrainingOptimizer(ABC):
    """What the trainer steps. ``torch_optimizer`` is the ``torch.optim`` optimizer whose
    ``param_groups`` the LR schedule drives; ``state_dict``/``load_state_dict`` are the
    checkpoint form (the Stateful protocol of torch.distributed.checkpoint)."""

    torch_optimizer: torch.optim.Optimizer
    checkpoint_layout: str
    """How the state is keyed in a checkpoint (`LAYOUT_INDEPENDENT` or `per_rank_layout`): a
    checkpoint resumes only into an optimizer of the same layout."""

    @property
    def param_groups(self) -> list[dict]:
        """The param groups (and their ``lr``) of ``torch_optimizer``."""
        return self.torch_optimizer.param_groups

    @property
    def state(self) -> dict:
        """Per-parameter state of ``torch_optimizer`` (moments, step)."""
        return self.torch_optimizer.state

    def grad_shards(self) -> list[torch.Tensor]:
        """Gradients held by the optimizer itself rather than in the parameters' ``.grad``
        (ZeRO-2's reduce-scattered chunks); none by default."""
        return []

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Tensors of the optimizer beyond its per-parameter state (ZeRO's fp32 master chunks,
        counted with the optimizer states as in the ZeRO paper's K·Ψ); none by default."""
        return []

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every rank's gradients (equal on all ranks), scaling them
        so it is at most ``max_norm`` (``inf`` measures only). Returns the norm before."""

    @abstractmethod
    def step(self) -> None:
        """Apply the update from the accumulated gradients."""

    def zero_grad(self) -> None:
        """Drop the gradients."""
        self.torch_optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state in checkpoint form (creates empty per-parameter state first if needed, so
        that a load can fill it in place)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state produced by `state_dict` (of the same ``checkpoint_layout``)."""

    def after_weights_loaded(self) -> None:  # noqa: B027 - a hook: optional, empty by default
        """Called after the model's weights were replaced (checkpoint or ``init_from``)."""


class StandardOptimizer(TrainingOptimizer):
    """A ``torch.optim`` optimizer over ``model``'s parameters (plain or DTensor), with its state
    keyed by parameter names through ``torch.distributed.checkpoint.state_dict`` (so resumable
    on any layout). ``norm_group`` is the process group whose ranks hold disjoint parameters
    (the pipeline stages), over which the squared gradient norms are summed."""

    checkpoint_layout = LAYOUT_INDEPENDENT

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        norm_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.torch_optimizer = optimizer
        self.norm_group = norm_group
        self._grad_scale: torch.Tensor | None = None  # the clip's 1 / coefficient, for step()

    def _clips_in_step(self, params: list[torch.Tensor]) -> bool:
        """Whether the clipping scale can ride on the update: torch's fused Adam / AdamW over
        plain tensors divide every gradient by ``grad_scale`` inside their one pass over the
        state (the attribute `torch.amp.GradScaler` sets on optimizers that declare
        ``_step_supports_amp_scaling``), writing the scaled gradient back."""
        opt = self.torch_optimizer
        return (
            isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
            and getattr(opt, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in opt.param_groups)
            and not hasattr(opt, "grad_scale")  # a GradScaler of the caller's in charge
            and all(type(p) in (torch.Tensor, nn.Parameter) for p in params)
        )

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """DTensor-aware global-norm clipping (``densetrain.optim.clipping``).

        Over torch's fused Adam / AdamW on plain tensors the norm is measured here and the
        gradients are scaled by the next `step` inside the update's own pass (`_clips_in_step`;
        2 CPU cores, a 30M-parameter GPT: 10 ms a step less, one read and write of every
        gradient), with torch's coefficient min(1, max_norm / (norm + 1e-6)).
        """
        from densetrain.optim.clipping import clip_grad_norm_

        params = [p for g in self.torch_optimizer.param_groups for p in g["params"]]
        self._grad_scale = None
        if 0 < max_norm < math.inf and self._clips_in_step(params):
            total = clip_grad_norm_(params, 0.0, pp_group=self.norm_group)
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self._grad_scale = torch.reciprocal(coefficient)
            return total
        return clip_grad_norm_(params, max_norm, pp_group=self.norm_group)

    def step(self) -> None:
        """``torch_optimizer.step()``, scaling the gradients by the clip measured before."""
        scale, self._grad_scale = self._grad_scale, None
        if scale is None:
            self.torch_optimizer.step()
            return
        self.torch_optimizer.grad_scale = scale
        try:
            self.torch_optimizer.step()
        finally:
            del self.torch_optimizer.grad_scale

    def zero_grad(self) -> None:
        """Drop the gradients (and a clip not yet applied to them)."""
        self._grad_scale = None
        super().zero_grad()

    # The state and the param groups' settings keyed by parameter name
    # (``param_groups.<name>.lr``), not by group index: under pipeline parallel every stage has
    # a group 0 over other parameters, and DCP, which keeps one copy of a key that every rank
    # writes, would give every stage the first stage's group (and a stage with no match a group
    # without its settings).
    flat_param_groups = True

    def use_checkpoint_layout(self, key: str, stored_keys: set[str]) -> None:
        """Read a checkpoint written with groups keyed by index (``<key>.param_groups.0.lr``,
        before they were keyed by name) in that layout."""
        self.flat_param_groups = f"{key}.param_groups.0.params" not in stored_keys

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flat_param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The state keyed by fully-qualified parameter names (layout-independent)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.torch_optimizer, options=self._options())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a name-keyed state (resharded to this layout by DCP)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.torch_optimizer, state_dict,
                                 options=self._options())
        self.flat_param_groups = True  # the next save writes the current layout
