"""A save that fails because a peer rank was lost ends the run as a rank failure (exit 4, the
lost rank named), not as a checkpoint error with the backend's text; other failures stay
`CheckpointError`s."""

from __future__ import annotations

import errno

from torch.distributed.checkpoint.api import CheckpointException

from densetrain.checkpoint import CheckpointError
from densetrain.checkpoint.saving import lost_peer, save_failure
from densetrain.errors import RankFailure
from densetrain.parallel.distributed import CollectiveError

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:7042: Connection reset by peer. GLHF!")


def test_a_reset_connection_inside_a_save_is_a_lost_peer(tmp_path) -> None:
    failure = save_failure(RuntimeError(GLOO), tmp_path, 12)
    assert isinstance(failure, CollectiveError) and isinstance(failure, RankFailure)
    assert "a collective did not complete" in str(failure)
    assert "GLHF" not in str(failure) and "pair.cc" not in str(failure)
    assert failure.backend_error == GLOO


def test_a_rank_failure_inside_dcps_checkpoint_exception_is_found(tmp_path) -> None:
    wrapped = CheckpointException("save failed", {1: (RuntimeError(GLOO), None)})
    assert isinstance(lost_peer(wrapped), RuntimeError)
    assert isinstance(save_failure(wrapped, tmp_path, 3), CollectiveError)
    chained = OSError("write failed")
    chained.__cause__ = RuntimeError(GLOO)
    assert isinstance(save_failure(chained, tmp_path, 3), CollectiveError)


def test_other_failures_stay_checkpoint_errors(tmp_path) -> None:
    full = save_failure(OSError(errno.ENOSPC, "No space left on device"), tmp_path, 7)
    assert type(full) is CheckpointError
    assert str(full).startswith(f"saving checkpoint step 7 into {tmp_path} failed: no space")
    bug = save_failure(ValueError("shape mismatch"), tmp_path, 7)
    assert type(bug) is CheckpointError and "ValueError: shape mismatch" in str(bug)
    named = save_failure(RuntimeError("boom"), "s3://b/run", 7, lambda e: f"remote: {e}")
    assert str(named) == "remote: boom"
