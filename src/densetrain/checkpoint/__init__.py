"""Checkpoints of the whole Stateful tree through torch.distributed.checkpoint.

`save_checkpoint` / `load_checkpoint` work on one process and on many (FSDP2/TP-sharded models
included); a checkpoint becomes visible only when complete; `latest_checkpoint` ignores partial
ones; `prune_checkpoints` keeps the newest k.
"""

from densetrain.checkpoint.manager import (
    CheckpointError,
    CheckpointShapeError,
    NonFiniteStateError,
    checkpoint_name,
    checkpoint_tensor_shapes,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_config,
    save_checkpoint,
)
from densetrain.checkpoint.state import (
    ModelState,
    RNGState,
    TrainerCounters,
    capture_rng_state,
    restore_rng_state,
)

__all__ = [
    "CheckpointError",
    "CheckpointShapeError",
    "ModelState",
    "NonFiniteStateError",
    "RNGState",
    "TrainerCounters",
    "capture_rng_state",
    "checkpoint_name",
    "checkpoint_tensor_shapes",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_checkpoint_config",
    "restore_rng_state",
    "save_checkpoint",
]
