"""Stateful wrappers so that one `torch.distributed.checkpoint` save/load covers a whole job.

Every entry of the tree handed to `save_checkpoint` has ``state_dict()`` / ``load_state_dict()``
(the `torch.distributed.checkpoint.stateful.Stateful` protocol): DCP calls ``state_dict()`` to
build the template, reads into it in place, then calls ``load_state_dict()``.

* `ModelState` goes through `torch.distributed.checkpoint.state_dict` (`get_model_state_dict`),
  which turns FSDP2/TP-sharded parameters into DTensors with their global shapes and strips
  wrapper prefixes (``_orig_mod.`` from `torch.compile`, activation-checkpoint wrappers), so a
  checkpoint is layout-independent. Optimizers are Stateful themselves
  (``densetrain.optim.interface.TrainingOptimizer``).
* `RNGState` keeps one entry per rank (torch CPU and CUDA generators, NumPy, Python `random`),
  pickled to bytes because the generator states are opaque and differ in size between builds.
* `TrainerCounters` holds the step and token counters.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict


class ModelState:
    """Stateful view of a (possibly sharded) model's parameters and persistent buffers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """The model's state with global (layout-independent) names and shapes."""
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy ``state_dict`` into the model (strict: every key must be present)."""
        set_model_state_dict(self.model, state_dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def capture_rng_state() -> bytes:
    """Pickle every random generator a training step can touch on this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def restore_rng_state(blob: bytes) -> None:
    """Restore the generators captured by `capture_rng_state`."""
    state = pickle.loads(blob)  # noqa: S301 - our own checkpoint, written by capture_rng_state
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            torch.cuda.set_rng_state(cuda_states[0])


class RNGState:
    """Per-rank random generator states; a rank absent from the checkpoint falls back to rank 0.

    The key holds the rank (``rank0``, ``rank1``...) so that ranks never overwrite each other's
    entry. Loading on more ranks than were saved gives the new ranks rank 0's generators.
    """

    def __init__(self, available_ranks: set[int] | None = None) -> None:
        self.rank = _rank()
        self.available_ranks = available_ranks

    def _key(self) -> str:
        if self.available_ranks is None or self.rank in self.available_ranks:
            return f"rank{self.rank}"
        return "rank0"

    def state_dict(self) -> dict[str, Any]:
        """``{"rank<r>": pickled generator states}`` for this process."""
        return {self._key(): capture_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's generators."""
        restore_rng_state(state_dict[self._key()])


@dataclass(kw_only=True)
class TrainerCounters:
    """Progress counters of a run: optimizer steps taken and training tokens consumed."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain ints, the same on every rank."""
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters."""
        self.step = int(state_dict["step"])
        self.tokens = int(state_dict["tokens"])
