"""`LaidOutModel` is an interface with one implementation per layout, chosen where the model is
built: `build_model` returns a `PipelineParallelModel` exactly when pp > 1 and a `SpmdModel`
otherwise. Checked on real gloo ranks, with the pipelined model's validation loss against the
FSDP model's of the same seed on the same batch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from densetrain.models.config import ModelConfig
from densetrain.testing import run_distributed

SEED = 7


def _config() -> ModelConfig:
    return ModelConfig(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_dim=64, max_seq_len=16)


def _build(world: int, layout: dict):
    from densetrain.parallel.build import build_model
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims

    cfg = ParallelConfig(**layout)
    pmesh = ParallelDims.from_config(cfg, world).build_mesh("cpu")
    return build_model(_config(), cfg, pmesh, device=torch.device("cpu"), seed=SEED,
                       local_batch_size=2, micro_batch_size=1)


def _layouts(rank: int, world: int) -> dict:
    from densetrain.data import Batch
    from densetrain.errors import UserError

    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    batch = Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())
    out = {}
    for name, layout in (("fsdp", dict(dp_shard=2)), ("pp", dict(pp=2, pp_microbatches=2))):
        model = _build(world, layout)
        prepared = model.prepare_batch(batch, torch.device("cpu"))
        loss = model.eval_loss(prepared, micro_batch_size=1, autocast=contextlib.nullcontext)
        masked = Batch(inputs=batch.inputs, targets=batch.targets,
                       document_ids=torch.zeros_like(batch.inputs))
        try:
            model.prepare_batch(masked, torch.device("cpu"))
            refused = False
        except UserError:
            refused = True
        out[name] = dict(kind=type(model).__name__, pipelined=model.is_pipelined,
                         has_pipeline=model.pipeline is not None, loss=loss.item(),
                         refuses_document_ids=refused)
    return out


def test_base_is_abstract_and_spmd_has_no_pipeline():
    from densetrain.parallel.model import LaidOutModel, SpmdModel

    with pytest.raises(TypeError):
        LaidOutModel(module=torch.nn.Identity())
    model = SpmdModel(module=torch.nn.Identity())
    assert model.pipeline is None and not model.is_pipelined and model.cp_size == 1


def test_built_model_is_pipelined_exactly_when_pp_above_one():
    results = run_distributed(_layouts, 2, timeout=180)
    for per_rank in results:
        assert per_rank["fsdp"]["kind"] == "SpmdModel"
        assert not per_rank["fsdp"]["pipelined"] and not per_rank["fsdp"]["has_pipeline"]
        assert not per_rank["fsdp"]["refuses_document_ids"]
        assert per_rank["pp"]["kind"] == "PipelineParallelModel"
        assert per_rank["pp"]["pipelined"] and per_rank["pp"]["has_pipeline"]
        assert per_rank["pp"]["refuses_document_ids"]
        # Both ranks of the pp group report the last stage's loss; the same weights under
        # FSDP give the same mean cross-entropy over the same two sequences.
        assert per_rank["pp"]["loss"] == pytest.approx(per_rank["fsdp"]["loss"], rel=1e-5)
