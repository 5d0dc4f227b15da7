"""Transformer behaviour: every switch trains (forward+backward), padding never shows, document
masking equals separate runs, meta build + init_weights is bit-identical per seed, pipeline-style
stages compose to the full model. Logit parity with ``transformers`` is in
test_transformer_reference.py."""

from __future__ import annotations

import math

import pytest
import torch

from densetrain.models import ModelConfig, Transformer
from densetrain.models.masks import AttentionMask

VOCAB = 256


def tiny(**changes) -> ModelConfig:
    """A tiny LLaMA: dim 64, 2 layers, 4 heads, 2 kv heads, vocab 256."""
    fields = dict(
        vocab_size=VOCAB,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=96,
        max_seq_len=64,
    )
    fields.update(changes)
    return ModelConfig(**fields)


SWITCHES = {
    "llama": {},
    "layernorm-bias": dict(norm_type="layernorm", norm_bias=True),
    "layernorm-nobias": dict(norm_type="layernorm", norm_bias=False),
    "embedding-norm": dict(norm_type="layernorm", norm_bias=True, embedding_norm=True),
    "no-final-norm": dict(final_norm=False),
    "learned-pos": dict(position_embedding="learned", learned_pos_offset=2),
    "partial-rope": dict(rotary_fraction=0.25),
    "llama3-rope": dict(rope_scaling={"factor": 8.0, "original_max_seq_len": 16}),
    "alibi-6-heads": dict(position_embedding="alibi", dim=96, num_heads=6, num_kv_heads=6),
    "nope": dict(position_embedding="none"),
    "mha": dict(num_kv_heads=4),
    "mqa": dict(num_kv_heads=1),
    "head-dim-32": dict(head_dim=32),
    "qkv-out-bias": dict(qkv_bias=True, attn_out_bias=True),
    "qk-norm": dict(qk_norm=True),
    "sliding-window": dict(sliding_window=5),
    "gelu": dict(activation="gelu", mlp_bias=True),
    "gelu-tanh": dict(activation="gelu_tanh"),
    "relu": dict(activation="relu"),
    "parallel-two-norms": dict(block_type="parallel"),
    "parallel-shared-norm": dict(block_type="parallel", parallel_shared_norm=True),
    "post-norm": dict(norm_type="layernorm", norm_position="post", final_norm=False),
    "tied": dict(tie_embeddings=True),
    "tied-head-bias": dict(tie_embeddings=True, lm_head_bias=True),
    "vocab-padding": dict(vocab_size=250, vocab_pad_multiple=64),
    "embed-projection": dict(embed_dim=32),
    "dropout": dict(dropout=0.1),
    "z-loss": dict(z_loss_coef=1e-4),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_forward_backward_every_switch(name):
    cfg = tiny(**SWITCHES[name])
    model = Transformer(cfg)
    model.init_weights(seed=1)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, cfg.vocab_size)
    out = model.compute_loss(tokens[:, :-1], tokens[:, 1:])
    assert torch.isfinite(out.loss)
    # near log(V) at init: std 0.02 weights give almost uniform predictions
    assert abs(out.ce_loss.item() - math.log(cfg.vocab_size)) < 0.5
    out.loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname
    grads = [p.grad.abs().sum() for p in model.parameters()]
    assert sum(g > 0 for g in grads) >= len(grads) - 1  # all but possibly unused padding-only


def test_common_path_uses_is_causal_without_mask():
    model = Transformer(tiny())
    mask = model._attention_mask(
        torch.arange(16)[None], torch.arange(16)[None], None, None, torch.float32
    )
    assert mask == AttentionMask(is_causal=True)
    window_model = Transformer(tiny(sliding_window=32))  # window longer than the sequence
    assert (
        window_model._attention_mask(torch.arange(16)[None], None, None, None, torch.float32).mask
        is None
    )


def test_vocab_padding_never_changes_logits():
    plain = Transformer(tiny(vocab_size=250))
    plain.init_weights(seed=3)
    padded = Transformer(tiny(vocab_size=250, vocab_pad_multiple=64))
    padded.init_weights(seed=4)
    state = plain.state_dict()
    padded_state = padded.state_dict()
    for key in ("tok_embeddings.weight", "output.weight"):
        padded_state[key][:250] = state[key]
        padded_state[key][250:] = 100.0  # padding rows that would dominate if they leaked
        state[key] = padded_state[key]
    padded.load_state_dict(state)
    tokens = torch.randint(0, 250, (2, 10))
    assert padded.tok_embeddings.weight.shape[0] == 256
    torch.testing.assert_close(padded(tokens), plain(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(position_embedding="alibi"),
        dict(position_embedding="learned"),
        dict(sliding_window=3),
    ],
)
def test_document_mask_equals_separate_documents(changes):
    model = Transformer(tiny(**changes)).eval()
    model.init_weights(seed=0)
    lengths = [5, 7, 4]
    tokens = torch.randint(0, VOCAB, (1, sum(lengths)))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(tokens, document_ids_BS=doc_ids)
        separate = torch.cat([model(part) for part in tokens.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)


def test_sliding_window_limits_attention():
    model = Transformer(tiny(sliding_window=4, num_layers=1)).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, VOCAB, (1, 12))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # one layer: position 4 and later cannot see token 0 any more
    torch.testing.assert_close(a[0, 4:], b[0, 4:], atol=0, rtol=0)
    assert not torch.allclose(a[0, 3], b[0, 3])


def test_forward_hidden_then_logits_equals_forward():
    model = Transformer(tiny(embed_dim=32, tie_embeddings=True)).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        hidden = model.forward_hidden(tokens)
        assert hidden.shape == (2, 9, 32)
        torch.testing.assert_close(model.logits(hidden), model(tokens), atol=0, rtol=0)


def test_chunked_loss_through_the_model_matches_full_logits():
    model = Transformer(tiny(vocab_size=250, vocab_pad_multiple=64, z_loss_coef=1e-3))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 250, (2, 11))
    full = model.compute_loss(tokens[:, :-1], tokens[:, 1:])
    full.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked = model.compute_loss(tokens[:, :-1], tokens[:, 1:], chunk_size=7)
    chunked.loss.backward()
    torch.testing.assert_close(chunked.loss, full.loss)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-6, rtol=1e-5)


def test_meta_build_init_is_bit_identical_and_seeded():
    cfg = tiny(qkv_bias=True, norm_type="layernorm", norm_bias=True, tie_embeddings=True)
    eager = Transformer(cfg)
    eager.init_weights(seed=7)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=7)
    for (name, a), (_, b) in zip(
        eager.state_dict().items(), lazy.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    other = Transformer(cfg)
    other.init_weights(seed=8)
    assert not torch.equal(other.layers["0"].attn.wq.weight, eager.layers["0"].attn.wq.weight)
    tokens = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(eager(tokens), lazy(tokens), atol=0, rtol=0)


def test_init_statistics_follow_gpt2_rules():
    cfg = tiny(
        dim=128, ffn_dim=512, num_layers=8, qkv_bias=True, norm_type="layernorm", norm_bias=True
    )
    model = Transformer(cfg)
    model.init_weights(seed=0)
    layer = model.layers["3"]
    assert torch.equal(layer.attn_norm.weight, torch.ones(128))
    assert torch.equal(layer.attn.wq.bias, torch.zeros(cfg.q_dim))
    assert layer.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * cfg.num_layers)
    assert layer.mlp.w_down.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert layer.attn.wo.weight.std().item() == pytest.approx(residual, rel=0.05)
    unscaled = Transformer(cfg.replace(scale_residual_init=False))
    unscaled.init_weights(seed=0)
    assert unscaled.layers["3"].mlp.w_down.weight.std().item() == pytest.approx(0.02, rel=0.05)


def _stage(cfg: ModelConfig, keep_layers: set[str], first: bool, last: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    for name in list(model.layers):
        if name not in keep_layers:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    return model


def test_pipeline_stages_compose_to_the_full_model():
    cfg = tiny(num_layers=4, tie_embeddings=False)
    full = Transformer(cfg).eval()
    full.init_weights(seed=5)
    first = _stage(cfg, {"0", "1"}, first=True, last=False).eval()
    last = _stage(cfg, {"2", "3"}, first=False, last=True).eval()
    for name, param in first.named_parameters():  # partial models get identical values
        assert torch.equal(param, full.get_parameter(name)), name
    torch.testing.assert_close(
        last.output.weight,
        full.output.weight,
        atol=0,
        rtol=0,
    )
    tokens = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 10, cfg.dim)
        torch.testing.assert_close(last(hidden), full(tokens), atol=1e-6, rtol=1e-6)


def test_dropout_only_in_training():
    model = Transformer(tiny(dropout=0.5))
    model.init_weights(seed=0)
    tokens = torch.randint(0, VOCAB, (1, 8))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), atol=0, rtol=0)
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))


def test_explicit_positions_shift_rope_consistently():
    """RoPE is relative: shifting every position by the same amount keeps the logits."""
    model = Transformer(tiny()).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        base = model(tokens)
        shifted = model(tokens, positions_BS=torch.arange(8)[None] + 20)
    torch.testing.assert_close(base, shifted, atol=1e-4, rtol=1e-4)


def _fsdp_init_full_state(rank: int, world_size: int, cfg_dict: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from densetrain.parallel.parallelize import init_weights

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(cfg_dict))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init_weights(model, 11)
    return {name: param.full_tensor() for name, param in model.named_parameters()}


def test_init_weights_on_fsdp_sharded_model_matches_one_process():
    from densetrain.testing import run_distributed

    cfg = tiny(vocab_size=250, qkv_bias=True)  # 250 rows: uneven shards over 2 ranks
    reference = Transformer(cfg)
    reference.init_weights(seed=11)
    states = run_distributed(_fsdp_init_full_state, 2, cfg.to_dict())
    for state in states:
        for name, param in reference.named_parameters():
            assert torch.equal(state[name], param), name


def test_alibi_slopes_follow_press_et_al():
    """Press et al. 2022 §3: 8 heads get 2^-1 ... 2^-8; a non-power-of-two count n takes the
    2^floor(log2 n) sequence plus every other slope of the next power's sequence."""
    from densetrain.models.positions import alibi_slopes

    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    expected_6 = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert alibi_slopes(6).tolist() == expected_6


def test_llama3_rope_scaling_bands():
    """Llama 3.1 scaling keeps short wavelengths, divides long ones by the factor."""
    from densetrain.models.positions import rope_inv_freq

    plain = rope_inv_freq(tiny(head_dim=64, num_heads=1, num_kv_heads=1, rope_theta=500000.0))
    scaled = rope_inv_freq(
        tiny(
            head_dim=64,
            num_heads=1,
            num_kv_heads=1,
            rope_theta=500000.0,
            rope_scaling={"factor": 8.0, "original_max_seq_len": 8192},
        )
    )
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8)
    middle = ~short & ~long
    assert middle.any() and (scaled[middle] < plain[middle]).all()
    assert (scaled[middle] > plain[middle] / 8).all()
