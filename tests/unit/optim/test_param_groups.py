"""Decay / no-decay grouping: weights of linear layers decay; norms, biases and (by option)
embeddings do not. The reference is the parameter-name table of models/transformer.py."""

import pytest
import torch
from torch import nn

from densetrain.models.config import ModelConfig
from densetrain.models.transformer import Transformer
from densetrain.optim.param_groups import classify_parameters, param_groups

TINY = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=64, max_seq_len=16)


def _gpt2_like(**changes) -> Transformer:
    cfg = ModelConfig(norm_type="layernorm", norm_bias=True, position_embedding="learned",
                      activation="gelu", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
                      **TINY).replace(**changes)
    return Transformer(cfg)


def _reference_no_decay(name: str, decay_embeddings: bool) -> bool:
    # From the architecture table: biases, every *norm*, the embedding tables.
    if name.endswith(".bias") or "norm" in name.split(".")[-2]:
        return True
    return name in ("tok_embeddings.weight", "pos_embeddings.weight") and not decay_embeddings


def _group_names(model: nn.Module, decay_embeddings: bool) -> dict[str, list[str]]:
    groups = param_groups(model, weight_decay=0.1, decay_embeddings=decay_embeddings)
    return {g["name"]: g["param_names"] for g in groups}


@pytest.mark.parametrize("decay_embeddings", [False, True])
@pytest.mark.parametrize("model_changes", [
    {},                                         # GPT-2: LayerNorm with bias, learned positions
    {"tie_embeddings": True, "lm_head_bias": True},
    {"norm_type": "rmsnorm", "norm_bias": False, "position_embedding": "rope",
     "activation": "swiglu", "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False,
     "qk_norm": True},                          # LLaMA/Qwen3-like
    {"embedding_norm": True, "position_embedding": "alibi"},    # BLOOM-like
])
def test_groups_follow_the_architecture_table(model_changes, decay_embeddings):
    model = _gpt2_like(**model_changes)
    names = _group_names(model, decay_embeddings)
    all_names = [n for n, _ in model.named_parameters()]
    assert sorted(names.get("decay", []) + names.get("no_decay", [])) == sorted(all_names)
    for name in all_names:
        expected = "no_decay" if _reference_no_decay(name, decay_embeddings) else "decay"
        assert name in names[expected], (name, expected)
    groups = param_groups(model, weight_decay=0.1, decay_embeddings=decay_embeddings)
    assert {g["name"]: g["weight_decay"] for g in groups} == {"decay": 0.1, "no_decay": 0.0}


def test_tied_output_matrix_is_an_embedding():
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(10, 4)
    model.output = nn.Linear(4, 10, bias=False)
    model.output.weight = model.tok_embeddings.weight  # HF-style tying: one tensor, two owners
    kinds = classify_parameters(model)
    assert kinds == {"tok_embeddings.weight": "embedding"}
    assert _group_names(model, False) == {"no_decay": ["tok_embeddings.weight"]}
    assert _group_names(model, True) == {"decay": ["tok_embeddings.weight"]}


class ScaleNorm(nn.Module):
    """A custom norm with a 2-D gain: rank alone would decay it."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(2, 4))


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.matrix = nn.Parameter(torch.ones(3, 3))
        self.gate = nn.Parameter(torch.ones(3))


def test_module_type_beats_rank_and_rank_is_only_the_fallback():
    model = nn.Module()
    model.norm = ScaleNorm()
    model.custom = Custom()
    model.proj = nn.Linear(4, 4)
    model.frozen = nn.Linear(2, 2)
    model.frozen.requires_grad_(False)
    kinds = classify_parameters(model)
    assert kinds == {"norm.gain": "norm", "custom.matrix": "other", "custom.gate": "other",
                     "proj.weight": "weight", "proj.bias": "bias"}
    names = _group_names(model, False)
    assert names == {"decay": ["custom.matrix", "proj.weight"],
                     "no_decay": ["norm.gain", "custom.gate", "proj.bias"]}
