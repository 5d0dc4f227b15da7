"""Stateful wrappers so that one `torch.distributed.checkpoint` save/load covers a whole job.

Every entry of the tree handed to `save_checkpoint` has ``state_dict()`` / ``load_state_dict()``
(the `torch.distributed.checkpoint.stateful.Stateful` protocol): DCP calls ``state_dict()`` to
build the template, reads into it in place, then calls ``load_state_dict()``.

* `ModelState` goes through `torch.distributed.checkpoint.state_dict` (`get_model_state_dict`),
  which turns FSDP2/TP-sharded parameters into DTensors with their global shapes and strips
  wrapper prefixes (``_orig_mod.`` from `torch.compile`, activation-checkpoint wrappers), so a
  checkpoint is layout-independent. Optimizers are Stateful themselves
  (``densetrain.optim.interface.TrainingOptimizer``).
* `RNGState` keeps one entry per rank (torch CPU and CUDA generators, NumPy, Python `random`)
  as one fixed-layout ``uint8`` tensor (`RNG_LAYOUT`), never a pickle: loading a checkpoint
  from elsewhere cannot run code through it.
* `TrainerCounters` holds the step and token counters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from densetrain.errors import UserError


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


# One rank's generators in a fixed binary layout (NumPy structured dtype, little-endian):
# torch's CPU Mersenne Twister state (5056 bytes in every build since torch 1.x), Python's
# `random` (version, 624 words + position, the cached Gaussian), NumPy's legacy global
# RandomState (624 words, position, the cached Gaussian) and the current CUDA device's state
# (16 bytes: seed and offset of its Philox generator), with a byte count (0 without CUDA).
_TORCH_STATE_BYTES = 5056
_CUDA_STATE_MAX_BYTES = 64
RNG_LAYOUT = np.dtype(
    [
        ("layout_version", "<i8"),
        ("torch", "u1", (_TORCH_STATE_BYTES,)),
        ("python_version", "<i8"),
        ("python_state", "<i8", (625,)),
        ("python_has_gauss", "<i8"),
        ("python_gauss", "<f8"),
        ("numpy_keys", "<u4", (624,)),
        ("numpy_pos", "<i8"),
        ("numpy_has_gauss", "<i8"),
        ("numpy_gauss", "<f8"),
        ("cuda_bytes", "<i8"),
        ("cuda", "u1", (_CUDA_STATE_MAX_BYTES,)),
    ]
)
_RNG_LAYOUT_VERSION = 1


def capture_rng_state() -> torch.Tensor:
    """Every random generator a training step can touch on this process, as a ``uint8`` tensor
    of `RNG_LAYOUT` (plain data, no pickle)."""
    record = np.zeros((), dtype=RNG_LAYOUT)
    record["layout_version"] = _RNG_LAYOUT_VERSION
    torch_state = torch.get_rng_state().numpy()
    if torch_state.size != _TORCH_STATE_BYTES:
        raise RuntimeError(f"torch CPU generator state is {torch_state.size} bytes, expected "
                           f"{_TORCH_STATE_BYTES}")
    record["torch"] = torch_state
    py_version, py_state, py_gauss = random.getstate()
    record["python_version"] = py_version
    record["python_state"] = py_state
    record["python_has_gauss"] = py_gauss is not None
    record["python_gauss"] = py_gauss or 0.0
    _, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    record["numpy_keys"], record["numpy_pos"] = keys, pos
    record["numpy_has_gauss"], record["numpy_gauss"] = has_gauss, gauss
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_state = torch.cuda.get_rng_state().numpy()
        if cuda_state.size > _CUDA_STATE_MAX_BYTES:
            raise RuntimeError(f"CUDA generator state of {cuda_state.size} bytes does not fit "
                               f"{_CUDA_STATE_MAX_BYTES}")
        record["cuda_bytes"] = cuda_state.size
        record["cuda"][: cuda_state.size] = cuda_state
    return torch.from_numpy(np.frombuffer(record.tobytes(), dtype=np.uint8).copy())


def restore_rng_state(state: torch.Tensor) -> None:
    """Restore the generators captured by `capture_rng_state`."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise UserError(
            f"RNG state is a {type(state).__name__}, expected a uint8 tensor: the checkpoint was "
            "written by an older densetrain or another program; it is not unpickled"
        )
    raw = state.detach().cpu().contiguous().numpy().tobytes()
    if len(raw) != RNG_LAYOUT.itemsize:
        raise UserError(f"RNG state of {len(raw)} bytes, expected {RNG_LAYOUT.itemsize}")
    record = np.frombuffer(raw, dtype=RNG_LAYOUT)[0]
    if int(record["layout_version"]) != _RNG_LAYOUT_VERSION:
        raise UserError(f"RNG state layout version {int(record['layout_version'])}, expected "
                        f"{_RNG_LAYOUT_VERSION}")
    torch.set_rng_state(torch.from_numpy(record["torch"].copy()))
    py_gauss = float(record["python_gauss"]) if record["python_has_gauss"] else None
    python_state = tuple(int(v) for v in record["python_state"])
    random.setstate((int(record["python_version"]), python_state, py_gauss))
    np.random.set_state(
        ("MT19937", record["numpy_keys"].copy(), int(record["numpy_pos"]),
         int(record["numpy_has_gauss"]), float(record["numpy_gauss"]))
    )
    cuda_bytes = int(record["cuda_bytes"])
    if cuda_bytes and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(record["cuda"][:cuda_bytes].copy()))


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
        """``{"rank<r>": generator states as a uint8 tensor}`` for this process."""
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
