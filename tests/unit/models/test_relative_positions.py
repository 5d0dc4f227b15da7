"""Transformer-XL relative positions (``position_embedding="relative_xl"``, models/relative.py).

The encoding is checked against a literal evaluation of Dai et al. 2019 §3.3,
A_ij = q_i·k_j + q_i·W_R R_{i-j} + u·k_j + v·W_R R_{i-j}, written here with Python loops over
i, j and the sinusoid's dims (no relative shift); the Gopher and Chinchilla presets against the
published sizes (Rae et al. 2021 Table 1; Hoffmann et al. 2022 Table 4).
"""

from __future__ import annotations

import math

import pytest
import torch

from densetrain.models.attention import Attention
from densetrain.models.config import ModelConfig
from densetrain.models.hf import config_to_hf, dt_param_shapes
from densetrain.models.masks import AttentionMask
from densetrain.models.presets import get_preset, list_presets
from densetrain.models.sizing import param_counts
from densetrain.models.transformer import Transformer
from densetrain.planner.params import sharded_params


def tiny_relative(**overrides) -> ModelConfig:
    fields = dict(vocab_size=61, dim=24, num_layers=2, num_heads=4, ffn_dim=48, max_seq_len=32,
                  position_embedding="relative_xl", activation="gelu")
    fields.update(overrides)
    return ModelConfig(**fields)


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random (u and v start at zero; the test needs them non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)


def _sinusoid(distance: int, dim: int) -> list[float]:
    half = dim // 2
    freqs = [10000.0 ** (-2 * m / dim) for m in range(half)]
    return [math.sin(distance * f) for f in freqs] + [math.cos(distance * f) for f in freqs]


def literal_relative_attention(attn: Attention, x_SD: torch.Tensor, offset: int = 0,
                               keys_x_TD: torch.Tensor | None = None) -> torch.Tensor:
    """Dai et al. 2019 §3.3 term by term for one sequence: queries from ``x_SD`` at key index
    offset + i, keys from ``keys_x_TD`` (default ``x_SD``), causal, then the output projection."""
    keys_x_TD = x_SD if keys_x_TD is None else keys_x_TD
    heads, k_dim, kv_heads = attn.num_heads, attn.head_dim, attn.num_kv_heads
    rel = attn.relative
    q = attn.wq(x_SD).view(len(x_SD), heads, k_dim)
    k = attn.wk(keys_x_TD).view(len(keys_x_TD), kv_heads, k_dim)
    v = attn.wv(keys_x_TD).view(len(keys_x_TD), kv_heads, k_dim)
    u = rel.content_bias.bias.view(heads, k_dim)
    v_bias = rel.position_bias.bias.view(heads, k_dim)
    w_r = rel.pos_proj.weight  # [H·K, D]
    dim = w_r.shape[1]
    out = torch.zeros(len(x_SD), heads, k_dim, dtype=x_SD.dtype)
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i in range(len(x_SD)):
            scores = []
            for j in range(offset + i + 1):
                r_vec = torch.tensor(_sinusoid(offset + i - j, dim), dtype=x_SD.dtype)
                pos_key = (w_r @ r_vec).view(heads, k_dim)[h]
                a = (q[i, h] @ k[j, g] + q[i, h] @ pos_key + u[h] @ k[j, g]
                     + v_bias[h] @ pos_key)
                scores.append(a / math.sqrt(k_dim))
            probs = torch.softmax(torch.stack(scores), dim=0)
            out[i, h] = sum(probs[j] * v[j, g] for j in range(len(scores)))
    return attn.wo(out.reshape(len(x_SD), heads * k_dim))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_equals_the_literal_formula(kv_heads):
    cfg = tiny_relative(num_kv_heads=kv_heads)
    attn = Attention(cfg).double()
    _randomise(attn)
    x_BSD = torch.randn(2, 7, cfg.dim, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(1))
    out_BSD = attn(x_BSD, rope=None, mask=AttentionMask(is_causal=True))
    for b in range(2):
        expected = literal_relative_attention(attn, x_BSD[b])
        torch.testing.assert_close(out_BSD[b], expected, rtol=1e-10, atol=1e-10)


def test_queries_after_cached_keys_use_their_distances():
    """S new queries over T = cached + new keys: query i sits at key index T - S + i (an
    explicit boolean mask, as a KV cache passes it)."""
    cfg = tiny_relative()
    attn = Attention(cfg).double()
    _randomise(attn, seed=3)
    keys_x_TD = torch.randn(9, cfg.dim, dtype=torch.float64)
    new = 3
    rel = attn.relative
    q_BHSK = attn.wq(keys_x_TD[-new:]).view(1, new, 4, -1).transpose(1, 2)
    k_BGTK = attn.wk(keys_x_TD).view(1, 9, 4, -1).transpose(1, 2)
    v_BGTK = attn.wv(keys_x_TD).view(1, 9, 4, -1).transpose(1, 2)
    allowed = torch.arange(9) <= torch.arange(9 - new, 9).unsqueeze(-1)
    out_BHSK = rel.attend(q_BHSK, k_BGTK, v_BGTK, AttentionMask(is_causal=False, mask=allowed),
                          dropout_p=0.0, enable_gqa=False)
    out_SD = attn.wo(out_BHSK.transpose(1, 2).reshape(new, cfg.q_dim))
    expected = literal_relative_attention(attn, keys_x_TD[-new:], offset=9 - new,
                                          keys_x_TD=keys_x_TD)
    torch.testing.assert_close(out_SD, expected, rtol=1e-10, atol=1e-10)


def test_causal_no_position_sees_a_later_token():
    cfg = tiny_relative()
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    _randomise(model)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % cfg.vocab_size
    logits, logits_changed = model(tokens), model(changed)
    torch.testing.assert_close(logits[:, :8], logits_changed[:, :8], rtol=0, atol=0)
    assert (logits[:, 8:] - logits_changed[:, 8:]).abs().max() > 1e-3


def test_document_mask_equals_separate_documents():
    """Relative distances inside a packed document are those of the document alone."""
    cfg = tiny_relative()
    model = Transformer(cfg).double()
    _randomise(model, seed=5)
    tokens = torch.randint(0, cfg.vocab_size, (1, 11))
    documents = torch.tensor([[0] * 4 + [1] * 7])
    packed = model(tokens, document_ids_BS=documents)
    torch.testing.assert_close(packed[:, :4], model(tokens[:, :4]))
    torch.testing.assert_close(packed[:, 4:], model(tokens[:, 4:]))


def test_kv_cache_decoding_equals_full_forward():
    from densetrain.generate import KVCache

    cfg = tiny_relative()
    model = Transformer(cfg).double().eval()
    _randomise(model, seed=7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    full = model(tokens)
    cache = KVCache(cfg, batch_size=2, max_len=16, dtype=torch.float64)
    steps = [model(tokens[:, :6], positions_BS=torch.arange(6).expand(2, -1), kv_cache=cache)]
    for t in range(6, 10):
        steps.append(model(tokens[:, t:t + 1], positions_BS=torch.full((2, 1), t),
                           kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


def test_bf16_autocast_close_to_fp32():
    cfg = tiny_relative()
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    reference = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(tokens)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0.05, atol=0.05)


def _compiled_block_matches_eager(backend: str) -> None:
    cfg = tiny_relative(num_layers=1)
    model = Transformer(cfg)
    model.init_weights(seed=1)
    _randomise(model.layers["0"].attn.relative, seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    results = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            model.layers["0"] = torch.compile(model.layers["0"], fullgraph=True,
                                              backend=backend)
        loss = model(tokens, targets_BS=targets).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss, grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for eager, compiled in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_torch_compile_traces_one_graph():
    """The block (regional compile, as parallel/compile.py) is captured as one graph with no
    break (fullgraph) and gives eager's loss and gradients (AOT autograd, no code generation)."""
    _compiled_block_matches_eager("aot_eager")


@pytest.mark.slow
def test_torch_compile_inductor_equals_eager():
    """The same through inductor's generated kernels (~35 s on CPU)."""
    _compiled_block_matches_eager("inductor")


def test_tiny_model_trains():
    cfg = tiny_relative()
    model = Transformer(cfg)
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (4, 17), generator=generator)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(data[:, :-1], targets_BS=data[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    rel = model.layers["0"].attn.relative
    assert rel.content_bias.bias.abs().sum() > 0 and rel.position_bias.bias.abs().sum() > 0


# Rae et al. 2021 Table 1 and Hoffmann et al. 2022 Table 4 print the sizes to 2-3 significant
# figures; the count must round to the printed figure: within half a unit of its last digit.
PRINTED_SIZES = {
    "gopher-44m": (44, 1e6), "gopher-117m": (117, 1e6), "gopher-417m": (417, 1e6),
    "gopher-1.4b": (1.4, 1e9), "gopher-7.1b": (7.1, 1e9), "gopher-280b": (280, 1e9),
    "chinchilla-70b": (70, 1e9),
}
LAST_DIGIT = {"gopher-1.4b": 0.1, "gopher-7.1b": 0.1}


@pytest.mark.parametrize("name", sorted(PRINTED_SIZES))
def test_preset_rounds_to_its_published_size(name):
    cfg = get_preset(name)
    assert cfg.position_embedding == "relative_xl"
    printed, unit = PRINTED_SIZES[name]
    half_digit = LAST_DIGIT.get(name, 1) / 2 * unit
    count = param_counts(cfg).total
    assert abs(count - printed * unit) <= half_digit, (name, count)
    assert printed * unit == cfg.extra["published_params"]


def test_position_parameters_are_the_gap_to_the_published_sizes():
    """Without W_R, u, v (RoPE instead) every preset falls 5.5-9.0% below its published size
    (280B: 258.2B, -7.8%; 70B: 64.7B, -7.6%), far outside the printed rounding; W_R, u, v are
    L·(d² + 2d), which closes the gap."""
    for name in PRINTED_SIZES:
        cfg = get_preset(name)
        rope = cfg.replace(position_embedding="rope")
        gap = param_counts(cfg).total - param_counts(rope).total
        assert gap == cfg.num_layers * (cfg.dim**2 + 2 * cfg.dim)
        assert param_counts(rope).total < 0.96 * cfg.extra["published_params"]


def test_preset_names_covered():
    assert {n for n in list_presets() if n.startswith(("gopher-", "chinchilla-"))} == set(
        PRINTED_SIZES)


@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 2}, {"head_dim": 8},
                                       {"tie_embeddings": True, "qkv_bias": True}])
def test_meta_model_count_equals_sizing_and_planner(overrides):
    cfg = tiny_relative(**overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    assert sharded_params(cfg, 1).total() == param_counts(cfg).total
    assert dt_param_shapes(cfg) == {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gopher-280b", "chinchilla-70b"])
def test_meta_model_of_the_large_presets_equals_sizing(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    assert sharded_params(cfg, 1).total() == param_counts(cfg).total


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "opt", "bloom", "phi"])
def test_hf_export_refuses_relative_positions(family):
    cfg = tiny_relative()
    with pytest.raises(ValueError, match="position_embedding='relative_xl'"):
        config_to_hf(cfg, family)


def test_config_refuses_sliding_window_and_odd_dim():
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_relative(sliding_window=8)
    with pytest.raises(ValueError, match="even dim"):
        tiny_relative(dim=25, num_heads=5)
