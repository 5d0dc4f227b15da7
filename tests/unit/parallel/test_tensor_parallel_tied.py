"""Tensor parallel on the GPT-2/GPT-3 architecture: the tied embedding stays one parameter.

After ``parallelize`` on 2 gloo ranks (tp2, with and without sequence parallel) the token
embedding and the output head share ONE vocab-parallel DTensor, the optimizer sees it once, it
is initialised to the one-process values, and the learned position table is replicated."""

from __future__ import annotations

import pytest
import torch

from densetrain.models import Transformer
from densetrain.models.config import ModelConfig
from densetrain.models.transformer import canonical_name
from densetrain.testing import run_distributed


def _gpt(**overrides) -> ModelConfig:
    base = dict(vocab_size=101, dim=64, num_layers=2, num_heads=4, ffn_dim=256, max_seq_len=16,
                norm_type="layernorm", norm_bias=True, position_embedding="learned",
                qkv_bias=True, attn_out_bias=True, activation="gelu_tanh", mlp_bias=True,
                tie_embeddings=True)
    base.update(overrides)
    return ModelConfig(**base)


def _check_tied(rank: int, world: int, layout: dict, cfg_dict: dict) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims
    from densetrain.parallel.parallelize import build_optimizer, init_weights, parallelize

    cfg = ParallelConfig(**layout)
    pmesh = ParallelDims.from_config(cfg, world).build_mesh("cpu")
    model = parallelize(Transformer(ModelConfig.from_dict(cfg_dict)), pmesh, cfg)
    init_weights(model, 7)
    embedding = model.tok_embeddings.weight
    opt = build_optimizer(model, pmesh, cfg,
                          lambda groups: torch.optim.AdamW(groups, lr=1e-3, foreach=False))
    optimizer_params = [p for g in opt.torch_optimizer.param_groups for p in g["params"]]
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    model(tokens, targets_BS=torch.roll(tokens, 1, 1)).loss.backward()
    positions = model.pos_embeddings.weight
    return {
        "same_object": model.output_weight() is embedding,
        "no_output_weight": "output.weight" not in dict(model.named_parameters()),
        "in_optimizer": sum(p is embedding for p in optimizer_params),
        "unique_in_optimizer": len({id(p) for p in optimizer_params}) == len(optimizer_params),
        "embedding_layout": isinstance(embedding, DTensor)
        and tuple(embedding.placements) == (Shard(0),),
        "positions_layout": isinstance(positions, DTensor)
        and tuple(positions.placements) == (Replicate(),),
        "has_grad": embedding.grad is not None and positions.grad is not None,
        "weights": {canonical_name(n): p.full_tensor().detach().clone()
                    if isinstance(p, DTensor) else p.detach()
                    for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tied_embedding_is_one_parameter_after_tensor_parallel(sequence_parallel):
    cfg = _gpt()
    reference = Transformer(cfg)
    reference.init_weights(seed=7)
    layout = dict(tp=2, dp_shard=1, sequence_parallel=sequence_parallel)
    for result in run_distributed(_check_tied, 2, layout, cfg.to_dict()):
        assert result["same_object"]
        assert result["no_output_weight"]
        assert result["in_optimizer"] == 1
        assert result["unique_in_optimizer"]
        assert result["embedding_layout"]
        assert result["positions_layout"]
        assert result["has_grad"]
        # initialised once, to the bits one process holds
        assert result["weights"].keys() == dict(reference.named_parameters()).keys()
        for name, param in reference.named_parameters():
            assert torch.equal(result["weights"][name], param), name
