"""Hugging Face interop against `transformers` itself: tiny random models built from configs (no
download) are loaded into densetrain, compared on fp32 logits and greedy continuations, exported
back and reloaded by `transformers`."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from densetrain.models import ModelConfig, Transformer  # noqa: E402
from densetrain.models.hf import config_to_hf, load_hf, save_hf  # noqa: E402

VOCAB = 96
BATCH, SEQ = 2, 16
NEW_TOKENS = 8
LOGIT_ATOL = 1e-4


def _random_hf_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """A `transformers` causal LM with every parameter perturbed (norm weights and biases too, so
    a swapped or dropped norm/bias shows in the logits)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


CASES = {
    "gpt2-tied": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    ),
    "gpt2-untied-relu": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96,
        activation_function="relu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    ),
    "llama-gqa2-headdim-llama31-scaling": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "llama-biases-tied": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        max_position_embeddings=64,
    ),
    "mistral-window-shorter-than-seq": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
        max_position_embeddings=64,
    ),
    "qwen3-qknorm-headdim-tied": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=64,
    ),
    "qwen3-all-layers-sliding": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
        max_window_layers=0, max_position_embeddings=64,
    ),
    "neox-partial-rotary-parallel": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=64,
    ),
    "neox-sequential-tied": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.5, use_parallel_residual=False,
        tie_word_embeddings=True, max_position_embeddings=64,
    ),
    "opt-prenorm": lambda: transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
    ),
    "opt-350m-style-postnorm-project": lambda: transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
        do_layer_norm_before=False, dropout=0.0,
    ),
    "bloom-alibi-6-heads": lambda: transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6
    ),
    "phi-partial-rotary-shared-norm": lambda: transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, partial_rotary_factor=0.5, max_position_embeddings=64,
    ),
}


def _tokens(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _greedy(logits_fn, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by full recomputation (no KV cache on either side)."""
    for _ in range(steps):
        next_token = logits_fn(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    hf_model = _random_hf_model(CASES[request.param]())
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory / "hf")
    return request.param, hf_model, directory


@torch.no_grad()
def test_load_matches_transformers_logits_and_greedy(hf_case):
    name, hf_model, directory = hf_case
    model = load_hf(directory / "hf").eval()
    tokens = _tokens()
    expected = hf_model(tokens).logits
    actual = model(tokens)
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{name}: max |logit diff| {diff}"

    prompt = tokens[:, :6]
    hf_out = _greedy(lambda t: hf_model(t).logits, prompt, NEW_TOKENS)
    assert torch.equal(_greedy(model, prompt, NEW_TOKENS), hf_out), name


@torch.no_grad()
def test_export_roundtrip_is_lossless(hf_case):
    name, hf_model, directory = hf_case
    model = load_hf(directory / "hf")
    save_hf(model, directory / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        directory / "export", attn_implementation="eager"
    ).eval()
    original = hf_model.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, original[key]), f"{name}: {key} changed in the round trip"
    tokens = _tokens(2)
    assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits), name


@torch.no_grad()
def test_sharded_export_and_import(tmp_path):
    hf_model = _random_hf_model(CASES["llama-gqa2-headdim-llama31-scaling"]())
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    save_hf(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    tokens = _tokens()
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "sharded", attn_implementation="eager"
    )
    assert torch.equal(reloaded_hf(tokens).logits, hf_model(tokens).logits)
    assert torch.equal(load_hf(tmp_path / "sharded")(tokens), model(tokens))


@torch.no_grad()
def test_padded_vocab_exports_only_real_rows(tmp_path):
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96,
        max_seq_len=64, vocab_pad_multiple=64, extra={"hf_family": "llama"},
    )
    model = Transformer(cfg)
    model.init_weights(seed=3)
    save_hf(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape[0] == VOCAB
    assert tensors["lm_head.weight"].shape[0] == VOCAB
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = _tokens()
    diff = (hf_model(tokens).logits - model(tokens)).abs().max().item()
    assert diff <= LOGIT_ATOL


# ------------------------------------------------------------------ bad input
def _write_config(directory, **config) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


def test_unsupported_model_type_names_it_and_lists_supported(tmp_path):
    _write_config(tmp_path, model_type="t5", architectures=["T5ForConditionalGeneration"])
    with pytest.raises(ValueError, match=r"'t5'.*supported.*llama"):
        load_hf(tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    hf_cfg = CASES["llama-biases-tied"]().to_dict()
    hf_cfg["architectures"] = ["LlamaForSequenceClassification"]
    _write_config(tmp_path, **hf_cfg)
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        load_hf(tmp_path)


@pytest.fixture()
def llama_checkpoint(tmp_path):
    hf_model = _random_hf_model(CASES["llama-gqa2-headdim-llama31-scaling"]())
    hf_model.save_pretrained(tmp_path)
    return tmp_path, load_file(tmp_path / "model.safetensors")


def test_missing_tensor_is_named(llama_checkpoint):
    directory, tensors = llama_checkpoint
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj"):
        load_hf(directory)


def test_unexpected_tensor_is_named(llama_checkpoint):
    directory, tensors = llama_checkpoint
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors model\.layers\.0\.self_attn\.extra"):
        load_hf(directory)


def test_misshaped_tensor_names_expected_and_found(llama_checkpoint):
    directory, tensors = llama_checkpoint
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight: expected \[64, 64\], found \[32, 64\]"):
        load_hf(directory)


def test_export_refuses_what_the_family_cannot_express(tmp_path):
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=64, num_layers=1, num_heads=4, qk_norm=True, max_seq_len=32
    )
    with pytest.raises(ValueError, match=r"'gpt2'.*qk_norm=True"):
        config_to_hf(cfg, "gpt2")
    model = Transformer(cfg)
    model.init_weights()
    with pytest.raises(ValueError, match="qk_norm"):
        save_hf(model, tmp_path / "out", hf_family="gpt2")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unsupported Hugging Face model_type 'gpt3'"):
        save_hf(model, tmp_path / "out", hf_family="gpt3")


def test_export_refuses_non_empty_target(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, num_layers=1, num_heads=4, max_seq_len=32)
    model = Transformer(cfg)
    model.init_weights()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf(model, tmp_path / "out", hf_family="llama")
    # overwrite replaces only a model directory (an earlier output), never any other directory
    with pytest.raises(FileExistsError, match="not a model directory"):
        save_hf(model, tmp_path / "out", hf_family="llama", overwrite=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"
    (tmp_path / "out" / "config.json").write_text("{}")
    save_hf(model, tmp_path / "out", hf_family="llama", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors"
    ]


@torch.no_grad()
def test_headless_gpt2_checkpoint_with_buffers_and_duplicate_head(tmp_path):
    # The original GPT-2 release stores GPT2Model keys ("h.0...", no "transformer." prefix), the
    # causal-mask buffers "h.N.attn.bias", and some tied checkpoints also store lm_head.weight.
    hf_model = _random_hf_model(CASES["gpt2-tied"]())
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    legacy = {k.removeprefix("transformer."): v.clone() for k, v in tensors.items()}
    legacy["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    legacy["lm_head.weight"] = legacy["wte.weight"].clone()
    save_file(legacy, tmp_path / "model.safetensors")
    tokens = _tokens()
    diff = (load_hf(tmp_path)(tokens) - hf_model(tokens).logits).abs().max().item()
    assert diff <= LOGIT_ATOL

    legacy["lm_head.weight"] = legacy["lm_head.weight"] + 1.0
    save_file(legacy, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_hf(tmp_path)


@torch.no_grad()
def test_load_with_dtype_casts_and_export_keeps_it(tmp_path):
    _random_hf_model(CASES["qwen3-qknorm-headdim-tied"]()).save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    save_hf(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "out" / "model.safetensors")[
        "model.embed_tokens.weight"
    ].dtype == torch.bfloat16


SWITCH_CONFIGS = [
    dict(norm_type="layernorm", norm_bias=True, position_embedding="learned",
         learned_pos_offset=2, embed_dim=32, qkv_bias=True, activation="gelu", mlp_bias=True,
         tie_embeddings=True, vocab_pad_multiple=16),
    dict(qk_norm=True, num_kv_heads=1, head_dim=24, block_type="parallel",
         parallel_shared_norm=True, lm_head_bias=True),
    dict(embedding_norm=True, norm_type="layernorm", position_embedding="alibi",
         attn_out_bias=True, block_type="parallel", tie_embeddings=True, lm_head_bias=True),
    dict(norm_position="post", final_norm=False, activation="relu", rotary_fraction=0.5),
]


@pytest.mark.parametrize("switches", SWITCH_CONFIGS)
def test_shape_table_matches_the_transformer(switches):
    from densetrain.models.hf import dt_param_shapes

    cfg = ModelConfig(vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, ffn_dim=80,
                      max_seq_len=32, **switches)
    with torch.device("meta"):
        model = Transformer(cfg)
    found = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert found == dt_param_shapes(cfg)


def test_keys_of_checkpoints_saved_without_the_head_wrapper_are_restored():
    from densetrain.models.hf import get_adapter

    opt = get_adapter("opt")
    expected = {"model.decoder.layers.0.fc1.weight"}
    assert opt.normalise_key("decoder.layers.0.fc1.weight", expected) == next(iter(expected))
    assert opt.normalise_key("layers.0.fc1.weight", expected) == next(iter(expected))
    assert opt.normalise_key("layers.0.fc9.weight", expected) == "layers.0.fc9.weight"


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama", "tiny-bloom", "tiny-opt"])
def test_build_transformers_model_has_the_exported_shapes(preset):
    from densetrain.models import Transformer, get_preset
    from densetrain.models.hf import build_transformers_model

    cfg = get_preset(preset)
    family = cfg.extra["hf_family"]
    hf = build_transformers_model(cfg, family)
    assert sum(p.numel() for p in hf.parameters()) == sum(
        p.numel() for p in Transformer(cfg).parameters()
    )


def test_gpt2_export_carries_the_model_dropout():
    from densetrain.models import get_preset
    from densetrain.models.hf import config_to_hf

    hf = config_to_hf(get_preset("tiny-gpt2").replace(dropout=0.1), "gpt2")
    assert (hf["resid_pdrop"], hf["embd_pdrop"], hf["attn_pdrop"]) == (0.1, 0.1, 0.1)
    assert config_to_hf(get_preset("tiny-gpt2"), "gpt2")["attn_pdrop"] == 0.0
