"""Generation: cached decoding equals recomputing the whole sequence; sampling filters."""

from __future__ import annotations

import re

import pytest
import torch

from densetrain.generate import KVCache, filter_logits, generate, sample_next
from densetrain.models import ModelConfig, Transformer


def tiny(**changes) -> ModelConfig:
    fields = dict(
        vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96, max_seq_len=64
    )
    fields.update(changes)
    return ModelConfig(**fields)


def greedy_without_cache(model: Transformer, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            next_token = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


CASES = {
    "llama-gqa": {},
    "sliding-window-rolling": dict(sliding_window=4),  # prompt and output longer than window
    "alibi": dict(position_embedding="alibi", num_kv_heads=4),
    "learned-positions": dict(position_embedding="learned", norm_type="layernorm"),
    "qwen3-like": dict(qk_norm=True, head_dim=32, num_kv_heads=1, tie_embeddings=True),
    "parallel-partial-rope": dict(block_type="parallel", rotary_fraction=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cached_greedy_equals_full_recompute(name):
    model = Transformer(tiny(**CASES[name]))
    model.init_weights(seed=2)
    with torch.no_grad():  # sharpen the model so that greedy choices are not near-ties
        model.output_weight().mul_(20)
    prompt = torch.randint(0, 97, (2, 7))
    expected = greedy_without_cache(model.eval(), prompt, steps=10)
    got = generate(model, prompt, max_new_tokens=10)
    assert torch.equal(got, expected)


def test_rolling_buffer_is_bounded_and_matches_logits():
    cfg = tiny(sliding_window=3)
    model = Transformer(cfg).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, 97, (1, 12))
    cache = KVCache(cfg, batch_size=1, max_len=12)
    assert cache.capacity == 3 and cache.layer(0).k_BGCK.shape[2] == 3
    with torch.no_grad():
        full = model(tokens)
        first = model(tokens[:, :5], positions_BS=torch.arange(5)[None], kv_cache=cache)
        steps = [
            model(tokens[:, i : i + 1], positions_BS=torch.tensor([[i]]), kv_cache=cache)
            for i in range(5, 12)
        ]
    torch.testing.assert_close(torch.cat([first] + steps, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="must continue the cached sequence at 12"):
        model(tokens[:, :1], positions_BS=torch.tensor([[3]]), kv_cache=cache)


def test_eos_pads_and_stops():
    model = Transformer(tiny())
    model.init_weights(seed=0)
    prompt = torch.randint(0, 97, (1, 4))
    free = generate(model, prompt, max_new_tokens=6)
    eos = int(free[0, 5])  # the second generated token
    first = 4 + int((free[0, 4:] == eos).nonzero()[0])  # its first appearance after the prompt
    stopped = generate(model, prompt, max_new_tokens=6, eos_token_id=eos)
    assert torch.equal(stopped, free[:, : first + 1])
    two = torch.cat([prompt, torch.randint(0, 97, (1, 4))])
    padded = generate(model, two, max_new_tokens=6, eos_token_id=eos)
    row = padded[0, 4:]
    after = int((row == eos).nonzero()[0]) if (row == eos).any() else len(row)
    assert (row[after:] == eos).all()  # a finished sequence is padded with eos


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept_k.tolist() == [[True, True, False, False]]
    # nucleus 0.8: 0.5 + 0.3 reaches it, so exactly two tokens remain
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).sum() == 3
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).sum() == 1  # the top one always
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(filter_logits(shuffled, top_p=0.8)).tolist() == [
        [False, True, False, True]
    ]


def test_sampling_frequencies_and_seeding():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(20000, 4)
    draws = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    freqs = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(freqs, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    top2 = sample_next(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(top2.tolist()) == {0, 1}
    assert abs((top2 == 0).float().mean().item() - 0.5 / 0.8) < 0.015
    model = Transformer(tiny())
    model.init_weights(seed=0)
    prompt = torch.randint(0, 97, (2, 3))
    runs = [
        generate(
            model, prompt, 5, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(1)
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(
        generate(model, prompt, 5, temperature=1.0, top_k=1), generate(model, prompt, 5)
    )


def test_the_run_sample_settings_mask_only_the_tail_and_zero_temperature_is_greedy():
    """The end-of-run sample's defaults (temperature 0.8, top-k 40, top-p 0.95): top-k and
    top-p together keep the tokens both keep; the nucleus is taken after the temperature;
    temperature 0 is the argmax whatever the generator; one seed gives one draw."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.log(probs)[[3, 0, 5, 1, 4, 2]].unsqueeze(0)  # likeliest at index 1, then 3
    # top-p 0.8 keeps 0.4 + 0.25 + 0.15 (indices 1, 3, 5); top-k 2 of those: 1 and 3
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=0.8))
    assert kept[0].nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(filter_logits(logits, top_k=40, top_p=0.8))[0].nonzero().flatten(
        ).tolist() == [1, 3, 5]  # k above the vocabulary: no cut
    # temperature 0.5 sharpens: 0.4 and 0.25 become 0.59 and 0.23 of the mass: two reach 0.8
    sharp = filter_logits(logits / 0.5, top_p=0.8)
    assert torch.isfinite(sharp)[0].nonzero().flatten().tolist() == [1, 3]
    batch = logits.expand(4000, 6)
    draws = sample_next(batch, temperature=0.8, top_k=40, top_p=0.95,
                        generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1, 3, 5, 4}  # 0.04 (index 2) lies outside the nucleus
    again = sample_next(batch, temperature=0.8, top_k=40, top_p=0.95,
                        generator=torch.Generator().manual_seed(0))
    other = sample_next(batch, temperature=0.8, top_k=40, top_p=0.95,
                        generator=torch.Generator().manual_seed(1))
    assert torch.equal(draws, again) and not torch.equal(draws, other)
    greedy = sample_next(batch, temperature=0.0, top_k=40, top_p=0.95,
                         generator=torch.Generator().manual_seed(5))
    assert greedy.unique().tolist() == [1]


def test_bad_arguments():
    model = Transformer(tiny(position_embedding="learned", max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
        generate(model, torch.zeros(1, 5, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(torch.zeros(1, 3), temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(torch.zeros(1, 3), top_p=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_k=2.5), "top_k must be a positive integer"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
])
def test_sampling_arguments_are_checked_before_the_first_token_even_when_greedy(kwargs, message):
    model = Transformer(tiny())
    model.init_weights(seed=0)
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (3,)])
def test_prompts_of_no_tokens_or_no_batch_are_refused(shape):
    model = Transformer(tiny())
    message = r"\[batch, prompt length\].*" + re.escape(str(list(shape)))
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(shape, dtype=torch.long), 3)
