"""Checkpoints of the whole Stateful tree through torch.distributed.checkpoint.

`save_checkpoint` / `load_checkpoint` work on one process and on many (FSDP2/TP-sharded models
included); a checkpoint becomes visible only when complete and carries a manifest (size and
SHA-256 of every file) that `verify_checkpoint` checks; `latest_checkpoint` ignores partial
ones; `prune_checkpoints` keeps the newest k. `AsyncCheckpointer` writes in the background
(async_save.py); `select_resume_checkpoint` verifies, sets damaged checkpoints aside and falls
back (resume.py); `check_resume_config` refuses a changed model or data order (resume.py);
`RunLock` keeps one run per directory (lock.py); `PreemptionHandler` turns SIGTERM/SIGINT into a
save and a clean exit (preemption.py). `CheckpointSession` is all a training run does with its
checkpoints, behind one object: schema and migrations, resume, saves, rollback (session.py).
"""

from densetrain.checkpoint.manager import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointShapeError,
    NonFiniteStateError,
    checkpoint_dirs,
    checkpoint_name,
    checkpoint_tensor_shapes,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_config,
    set_aside,
    verify_checkpoint,
)
from densetrain.checkpoint.manifest import Damage
from densetrain.checkpoint.saving import save_checkpoint
from densetrain.checkpoint.session import CheckpointSession, load_model_weights
from densetrain.checkpoint.state import (
    ModelState,
    RNGState,
    TrainerCounters,
    capture_rng_state,
    restore_rng_state,
)

__all__ = [
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointSession",
    "CheckpointShapeError",
    "Damage",
    "ModelState",
    "NonFiniteStateError",
    "RNGState",
    "TrainerCounters",
    "capture_rng_state",
    "checkpoint_dirs",
    "checkpoint_name",
    "checkpoint_tensor_shapes",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "prune_checkpoints",
    "read_checkpoint_config",
    "restore_rng_state",
    "save_checkpoint",
    "set_aside",
    "verify_checkpoint",
]
