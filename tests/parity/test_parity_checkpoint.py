"""A checkpoint saved on one layout loads on another and training continues with the control's
losses (model and AdamW state resharded by torch.distributed.checkpoint).

Tolerance as in test_parity_dp_tp.py (2e-5): resharding moves values exactly; only the layouts'
summation orders differ.
"""

from __future__ import annotations

import ladder
import pytest
import torch
from test_parity_dp_tp import LOSS_TOL, WEIGHT_TOL

from densetrain.testing import run_distributed

SEGMENTS = (range(0, 2), range(2, 4), range(4, 5))


def _chain(tmp_path, layouts: list[tuple[int, dict]]) -> tuple[list[float], dict]:
    losses, load_dir, weights = [], None, None
    for index, ((world, layout), steps) in enumerate(zip(layouts, SEGMENTS, strict=True)):
        save_dir = str(tmp_path / f"ckpt{index}")
        if world == 1:
            result = ladder.run_checkpoint_segment(0, 1, layout, load_dir, save_dir, steps)
        else:
            result = run_distributed(
                ladder.run_checkpoint_segment, world, layout, load_dir, save_dir, steps
            )[0]
        losses += result["losses"]
        weights = result["weights"]
        load_dir = save_dir
    return losses, weights


def _check(losses, weights, control):
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(control["losses"]), atol=LOSS_TOL, rtol=0
    )
    for name, ref in control["weights"].items():
        torch.testing.assert_close(weights[name], ref, atol=WEIGHT_TOL, rtol=0)


def test_fsdp2_to_tp2_to_one_process(tmp_path):
    control = ladder.run_control()
    losses, weights = _chain(
        tmp_path, [(2, dict(dp_shard=2)), (2, dict(tp=2, dp_shard=1)), (1, dict(dp_shard=1))]
    )
    _check(losses, weights, control)


@pytest.mark.slow
def test_fsdp4_to_tp2_dp2_to_one_process(tmp_path):
    control = ladder.run_control()
    losses, weights = _chain(
        tmp_path,
        [(4, dict(dp_shard=4)), (4, dict(tp=2, dp_shard=2)), (1, dict(dp_shard=1))],
    )
    _check(losses, weights, control)
