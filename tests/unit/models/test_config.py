"""ModelConfig: derived sizes and errors that name the field and what is allowed."""

from __future__ import annotations

import pytest

from densetrain.models import ModelConfig, RopeScaling


def make(**changes) -> ModelConfig:
    fields = dict(vocab_size=256, dim=64, num_layers=2, num_heads=4)
    fields.update(changes)
    return ModelConfig(**fields)


def test_derived_sizes():
    cfg = make(num_kv_heads=None, vocab_size=250, vocab_pad_multiple=64)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.embed_dim) == (4, 16, 256, 64)
    assert cfg.padded_vocab_size == 256 and cfg.q_dim == 64 and cfg.kv_dim == 64
    assert make(head_dim=32, num_kv_heads=2).q_dim == 128
    assert make(rotary_fraction=0.25).rotary_dim == 4
    assert make(position_embedding="alibi").rotary_dim == 0


def test_round_trip_and_replace():
    cfg = make(rope_scaling=RopeScaling(factor=4.0))
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again.rope_scaling, RopeScaling)
    assert cfg.replace(num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="unknown key 'n_layers' in ModelConfig; did you mean"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layers": 3})


@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(num_heads=5), r"num_heads \(5\) must divide dim \(64\).*head_dim"),
        (dict(num_kv_heads=3), r"num_kv_heads \(3\) must divide num_heads \(4\)"),
        (dict(head_dim=10, rotary_fraction=0.5), r"rotary dims .* must be even"),
        (dict(head_dim=6, rotary_fraction=0.1), r"rotary dims .* must be even and positive"),
        (dict(rotary_fraction=1.5), r"rotary_fraction must be in \(0, 1\]"),
        (dict(sliding_window=0), r"sliding_window must be a positive"),
        (dict(sliding_window=-4), r"sliding_window must be a positive"),
        (dict(activation="silu"), r"activation must be one of \['gelu', 'gelu_tanh', 'relu', "),
        (dict(norm_type="batchnorm"), r"norm_type must be one of \['layernorm', 'rmsnorm'\]"),
        (dict(position_embedding="sinusoidal"), r"position_embedding must be one of"),
        (dict(block_type="moe"), r"block_type must be one of"),
        (dict(num_layers=0), r"num_layers must be a positive integer"),
        (dict(vocab_pad_multiple=0), r"vocab_pad_multiple must be >= 1"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(parallel_shared_norm=True), r"parallel_shared_norm=True requires"),
        (dict(norm_position="post", block_type="parallel"), r"norm_position=\"post\""),
        (dict(rope_scaling={"factor": 0.0}), r"rope_scaling.factor must be > 0"),
        (
            dict(rope_scaling={"low_freq_factor": 4.0, "high_freq_factor": 1.0}),
            r"low_freq_factor < high_freq_factor",
        ),
        (dict(init_std=0.0), r"init_std must be > 0"),
        (dict(z_loss_coef=-1.0), r"z_loss_coef must be >= 0"),
    ],
)
def test_inconsistent_configs_raise_value_error(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(**changes)


def test_replace_rederives_sizes_that_were_not_given():
    base = ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=4)
    smaller = base.replace(dim=64)
    assert (smaller.head_dim, smaller.ffn_dim, smaller.embed_dim) == (16, 256, 64)
    assert smaller.num_kv_heads == 4
    fewer_heads = base.replace(num_heads=2)
    assert (fewer_heads.num_kv_heads, fewer_heads.head_dim) == (2, 64)


def test_replace_keeps_sizes_that_were_given():
    base = ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=4, head_dim=48, ffn_dim=300)
    changed = base.replace(dim=64)
    assert (changed.head_dim, changed.ffn_dim, changed.embed_dim) == (48, 300, 64)
