"""Parity ladder for Transformer-XL relative positions (``position_embedding="relative_xl"``):
FSDP and a two-stage pipeline train as the one-process control does (tolerances of
test_parity_dp_tp.py). Tensor and context parallel are refused for it by the layout rules.
Each case spawns its own ranks (~30 s on 2 cores): run with --runslow."""

from __future__ import annotations

import ladder
import pytest
from test_parity_dp_tp import assert_matches_control

from densetrain.testing import run_distributed

RELATIVE = {"position_embedding": "relative_xl"}


@pytest.fixture(scope="module")
def control():
    return ladder.run_control(model_overrides=RELATIVE)


@pytest.mark.slow
def test_fsdp_two_ranks_matches_control(control):
    (result,) = run_distributed(ladder.run_many, 2, [dict(dp_shard=2, _model=RELATIVE)])[0]
    assert_matches_control(result, control)


@pytest.mark.slow
def test_pipeline_two_stages_matches_control(control):
    layout = dict(pp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=4, _model=RELATIVE)
    (result,) = run_distributed(ladder.run_many_pipeline, 2, [layout])[0]
    assert_matches_control(result, control)
