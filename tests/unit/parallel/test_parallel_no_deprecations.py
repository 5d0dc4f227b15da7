"""The parallel steps call no deprecated torch API: a forward and backward of context parallel
(the differentiable K/V all-gather) and of DDP (torch's ``replicate``) on real gloo ranks, with
every ``FutureWarning`` turned into an error inside the ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

from densetrain.testing import run_distributed

SEQ = 16


def _step_with_future_warnings_as_errors(rank: int, world: int, layout: dict) -> float:
    warnings.simplefilter("error", FutureWarning)
    from densetrain.models import Transformer
    from densetrain.models.config import ModelConfig
    from densetrain.models.loss import cross_entropy_loss
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.context import local_positions, shard_sequence
    from densetrain.parallel.mesh import ParallelDims
    from densetrain.parallel.parallelize import init_weights, parallelize

    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, world)
    pmesh = dims.build_mesh("cpu")
    model_cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_dim=64, max_seq_len=SEQ)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model = parallelize(model, pmesh, cfg)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    generator = torch.Generator().manual_seed(rank if dims.cp == 1 else 0)
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kwargs = {}
    if dims.cp > 1:
        cp_rank = pmesh.local_rank("cp")
        inputs, targets = (shard_sequence(t, cp_rank, dims.cp) for t in (inputs, targets))
        kwargs["positions_BS"] = local_positions(SEQ, cp_rank, dims.cp).unsqueeze(0)
    loss = cross_entropy_loss(model(inputs, **kwargs), targets).loss
    loss.backward()
    return float(loss)


@pytest.mark.parametrize("layout", [dict(cp=2, dp_shard=1), dict(dp_replicate=2, dp_shard=1)],
                         ids=["cp2", "ddp2"])
def test_parallel_steps_raise_no_future_warning(layout):
    losses = run_distributed(_step_with_future_warnings_as_errors, 2, layout)
    assert all(torch.isfinite(torch.tensor(losses)))
