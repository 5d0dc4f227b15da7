"""Serving cost: KV-cache bytes and bytes read per decode step measured on densetrain's own
KV-cached generation of tiny models (MHA, GQA, MQA, sliding window; fp32 and bf16), FLOPs
against PaLM's count, the roofline bound and the largest batch against their definitions."""

from __future__ import annotations

import pytest
import torch

from densetrain.cli.main import main
from densetrain.generate import KVCache, generate, sampling
from densetrain.models import ModelConfig, Transformer
from densetrain.models.presets import get_preset
from densetrain.models.sizing import flops_per_token_palm, param_counts
from densetrain.planner.hardware import get_cluster
from densetrain.planner.serving import ServingSetup, mean_causal_keys, serving_cost


class RecordingKVCache(KVCache):
    """The real cache, remembering itself and the cached bytes each layer reads per forward."""

    made: list[RecordingKVCache] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_bytes_per_forward: list[int] = []
        RecordingKVCache.made.append(self)

    def key_positions(self, q_positions_BS):
        keys = super().key_positions(q_positions_BS)
        # Each layer's update reads filled_slots cached keys and values (kv_cache.py).
        per_layer = sum(
            self.layer(i).k_BGCK[:, :, : self.filled_slots].nbytes
            + self.layer(i).v_BGCK[:, :, : self.filled_slots].nbytes
            for i in range(len(self._layers))
        )
        self.read_bytes_per_forward.append(per_layer)
        return keys


CASES = {
    "mha": dict(num_heads=4, num_kv_heads=4),
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mqa": dict(num_heads=4, num_kv_heads=1),
    "window": dict(num_heads=4, num_kv_heads=2, sliding_window=8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cache_and_bytes_read_match_a_real_generation(monkeypatch, case, dtype):
    cfg = ModelConfig(vocab_size=97, dim=64, num_layers=3, max_seq_len=64, **CASES[case])
    model = Transformer(cfg)
    model.init_weights(seed=0)
    model = model.to(dtype)
    monkeypatch.setattr(sampling, "KVCache", RecordingKVCache)
    RecordingKVCache.made.clear()
    batch, prompt, new = 3, 5, 12
    tokens = torch.randint(0, 97, (batch, prompt), generator=torch.Generator().manual_seed(0))
    out = generate(model, tokens, new)
    assert out.shape == (batch, prompt + new)
    (cache,) = RecordingKVCache.made
    elem = torch.finfo(dtype).bits // 8
    context = prompt + new
    cost = serving_cost(cfg, get_cluster("h100"), ServingSetup(
        context_len=context, batch_size=batch, kv_bytes_per_elem=elem,
        weight_bytes_per_param=elem))
    measured = sum(cache.layer(i).k_BGCK.nbytes + cache.layer(i).v_BGCK.nbytes
                   for i in range(cfg.num_layers))
    assert measured == batch * cost.kv_bytes_per_sequence
    # The last forward feeds the token at position context - 2 (the final sample is not fed
    # back) and reads the cache of the context - 2 tokens before it.
    last = serving_cost(cfg, get_cluster("h100"), ServingSetup(
        context_len=context - 2, batch_size=batch, kv_bytes_per_elem=elem,
        weight_bytes_per_param=elem))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes == cost.weight_bytes
    assert cache.read_bytes_per_forward[-1] == batch * last.kv_bytes_per_sequence
    assert weight_bytes + cache.read_bytes_per_forward[-1] == last.decode_bytes_per_step


def test_decode_flops_are_the_forward_third_of_palms_count():
    cfg = get_preset("llama3-8b")
    cost = serving_cost(cfg, get_cluster("h100"), ServingSetup(context_len=4096))
    assert cost.decode_flops_per_token == pytest.approx(flops_per_token_palm(cfg, 4096) / 3)
    # Prefill attends (P + 1) / 2 keys on average without a window.
    assert mean_causal_keys(cfg, 4096) == pytest.approx(4097 / 2)
    mistral = get_preset("mistral-7b")  # window 4096
    assert mean_causal_keys(mistral, 8192) == pytest.approx(
        (4096 * 4097 / 2 + 4096 * 4096) / 8192)
    long = serving_cost(mistral, get_cluster("h100"), ServingSetup(context_len=32768))
    assert long.kv_slots_per_sequence == 4096
    assert long.decode_flops_per_token == pytest.approx(flops_per_token_palm(mistral, 32768) / 3)


def test_kv_bytes_per_sequence_by_attention_kind():
    # Llama 2 70B (GQA, 8 kv heads of 128, 80 layers): 320 KiB per token in bf16, so a 4096-token
    # sequence holds 1.25 GiB; Llama 2 7B (MHA) 0.5 MiB per token.
    setup = ServingSetup(context_len=4096)
    big = serving_cost(get_preset("llama2-70b"), get_cluster("h100"), setup)
    assert big.kv_bytes_per_token == 320 * 1024
    assert big.kv_bytes_per_sequence == 4096 * 320 * 1024
    small = serving_cost(get_preset("llama2-7b"), get_cluster("h100"), setup)
    assert small.kv_bytes_per_token == 512 * 1024
    # PaLM 540B uses multi-query attention: one kv head of 256 per layer.
    palm = serving_cost(get_preset("palm-540b"), get_cluster("tpu-v4"), setup)
    assert palm.kv_bytes_per_token == 2 * 118 * 256 * 2


def test_roofline_bound_and_largest_batch_follow_their_definitions():
    cfg, h100 = get_preset("llama2-70b"), get_cluster("h100")
    setup = ServingSetup(context_len=4096, batch_size=16, devices=8)
    cost = serving_cost(cfg, h100, setup)
    weights = param_counts(cfg).total * 2
    step_bytes = weights + 16 * cost.kv_bytes_per_sequence
    assert cost.decode_memory_bound_tokens_per_s == pytest.approx(
        16 / (step_bytes / (8 * h100.hbm_bytes_per_s)))
    assert cost.decode_compute_bound_tokens_per_s == pytest.approx(
        8 * h100.peak_flops / cost.decode_flops_per_token)
    assert cost.decode_tokens_per_s == cost.decode_memory_bound_tokens_per_s
    free = 8 * h100.memory_bytes * 0.9 - weights
    assert cost.max_batch * cost.kv_bytes_per_sequence <= free
    assert (cost.max_batch + 1) * cost.kv_bytes_per_sequence > free
    # GQA's smaller cache is what makes room: with 64 kv heads (and their larger K/V
    # projections) the cache per sequence is 8x larger.
    mha_cfg = cfg.replace(num_kv_heads=64)
    mha = serving_cost(mha_cfg, h100, setup)
    assert mha.kv_bytes_per_sequence == 8 * cost.kv_bytes_per_sequence
    mha_free = 8 * h100.memory_bytes * 0.9 - param_counts(mha_cfg).total * 2
    assert mha.max_batch == int(mha_free // mha.kv_bytes_per_sequence)
    too_big = serving_cost(get_preset("llama3-405b"), h100, ServingSetup(context_len=8192))
    assert too_big.max_batch == 0


@pytest.mark.parametrize("field,value", [("context_len", 0), ("batch_size", -1),
                                         ("devices", 0), ("memory_fraction", 1.5),
                                         ("weight_bytes_per_param", 0.0)])
def test_bad_setup_names_the_field(field, value):
    kwargs = {"context_len": 128, field: value}
    with pytest.raises(ValueError, match=f"serving {field}"):
        ServingSetup(**kwargs)


def test_model_info_serve(capsys):
    assert main(["model-info", "llama2-70b", "--serve", "--cluster", "h100-80gb",
                 "--serve-devices", "8", "--batch", "16", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "8 x h100-80gb" in out and "KV cache/sequence" in out and "largest batch" in out
    assert main(["model-info", "mistral-7b", "--serve", "--context", "32768", "--json"]) == 0
    import json

    serving = json.loads(capsys.readouterr().out)["serving"]
    assert serving["kv_slots_per_sequence"] == 4096 and serving["cluster"] == "h100-80gb"
    assert main(["model-info", "llama3-405b", "--serve"]) == 0
    assert "not reachable" in capsys.readouterr().out
    assert main(["model-info", "llama3-8b", "--serve", "--cluster", "nope"]) == 2
    assert "unknown cluster 'nope'" in capsys.readouterr().err
