"""Transformer logits against Hugging Face ``transformers`` models of the same architecture.

Each case builds a tiny random model in ``transformers`` from a config (nothing downloaded),
copies its weights into a densetrain ``Transformer`` with a hand-written key map (independent of
densetrain's own HF interop) and compares fp32 logits. Together the cases cover every switch:
RMSNorm/LayerNorm with and without bias, embedding norm, RoPE (partial, Llama 3.1 scaling),
learned positions (with OPT's offset), ALiBi with a head count that is not a power of two,
MHA/GQA/MQA, head_dim != dim/heads, QK-norm, QKV/output biases, sliding window, GELU exact and
tanh, ReLU, SwiGLU, sequential, parallel with one and with two norms, tied and untied heads.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from densetrain.models import ModelConfig, Transformer  # noqa: E402

VOCAB, DIM, LAYERS, SEQ = 128, 64, 2, 24


def _split_fused_per_head(weight, heads: int, head_dim: int):
    """NeoX/BLOOM fuse q, k, v per head: rows are [H, 3, K]."""
    w = weight.view(heads, 3, head_dim, *weight.shape[1:])
    return [w[:, i].reshape(heads * head_dim, *weight.shape[1:]) for i in range(3)]


def _remap(hf_sd: dict, cfg: ModelConfig, renames, *, fused_layers=None, skip=()) -> dict:
    """Rename HF keys by ordered substring replacements; ``fused_layers=(hf, attn)`` splits a
    per-head fused ``query_key_value`` (NeoX/BLOOM) found under layer prefix ``hf``."""
    out = {}
    for key, value in hf_sd.items():
        if key.startswith(skip):
            continue
        if fused_layers is not None and "query_key_value" in key:
            hf_layers, attn_name = fused_layers
            prefix = key.split(attn_name)[0].replace(hf_layers, "layers")
            suffix = key.rsplit(".", 1)[1]
            parts = _split_fused_per_head(value, cfg.num_heads, cfg.head_dim)
            for name, part in zip("qkv", parts, strict=True):
                out[f"{prefix}attn.w{name}.{suffix}"] = part
            continue
        for old, repl in renames:
            key = key.replace(old, repl)
        out[key] = value
    return out


_LLAMA_RENAMES = [
    ("model.embed_tokens", "tok_embeddings"), ("model.norm", "norm"), ("lm_head", "output"),
    ("model.layers", "layers"), ("self_attn.q_proj", "attn.wq"), ("self_attn.k_proj", "attn.wk"),
    ("self_attn.v_proj", "attn.wv"), ("self_attn.o_proj", "attn.wo"),
    ("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm"),
    ("mlp.gate_proj", "mlp.w_gate"), ("mlp.up_proj", "mlp.w_up"), ("mlp.down_proj", "mlp.w_down"),
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"),
]
_FUSED_BLOCK_RENAMES = [  # shared by NeoX and BLOOM after their own prefixes
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"),
    ("mlp.dense_h_to_4h", "mlp.w_up"), ("mlp.dense_4h_to_h", "mlp.w_down"),
]
_NEOX_RENAMES = [
    ("gpt_neox.embed_in", "tok_embeddings"), ("embed_out", "output"), ("lm_head", "output"),
    ("gpt_neox.final_layer_norm", "norm"), ("gpt_neox.layers", "layers"),
    ("attention.dense", "attn.wo"), *_FUSED_BLOCK_RENAMES,
]
_BLOOM_RENAMES = [
    ("transformer.word_embeddings_layernorm", "embed_norm"),
    ("transformer.word_embeddings", "tok_embeddings"), ("transformer.ln_f", "norm"),
    ("transformer.h", "layers"), ("self_attention.dense", "attn.wo"), *_FUSED_BLOCK_RENAMES,
]
_OPT_RENAMES = [
    ("model.decoder.embed_tokens", "tok_embeddings"),
    ("model.decoder.embed_positions", "pos_embeddings"),
    ("model.decoder.final_layer_norm", "norm"), ("model.decoder.layers", "layers"),
    ("self_attn.q_proj", "attn.wq"), ("self_attn.k_proj", "attn.wk"),
    ("self_attn.v_proj", "attn.wv"), ("self_attn.out_proj", "attn.wo"),
    ("self_attn_layer_norm", "attn_norm"), ("final_layer_norm", "mlp_norm"),
    ("fc1", "mlp.w_up"), ("fc2", "mlp.w_down"),
    ("model.decoder.project_in", "project_in"), ("model.decoder.project_out", "project_out"),
]
_PHI_RENAMES = [
    ("model.embed_tokens", "tok_embeddings"), ("model.final_layernorm", "norm"),
    ("lm_head", "output"), ("model.layers", "layers"), ("self_attn.q_proj", "attn.wq"),
    ("self_attn.k_proj", "attn.wk"), ("self_attn.v_proj", "attn.wv"),
    ("self_attn.dense", "attn.wo"), ("input_layernorm", "attn_norm"),
    ("mlp.fc1", "mlp.w_up"), ("mlp.fc2", "mlp.w_down"),
]


def _llama_like(hf_sd: dict, cfg: ModelConfig) -> dict:
    return _remap(hf_sd, cfg, _LLAMA_RENAMES)


def _neox(hf_sd: dict, cfg: ModelConfig) -> dict:
    return _remap(hf_sd, cfg, _NEOX_RENAMES, fused_layers=("gpt_neox.layers", "attention"))


def _bloom(hf_sd: dict, cfg: ModelConfig) -> dict:
    # BLOOM's head is tied to the word embeddings: its lm_head copy is dropped
    return _remap(
        hf_sd, cfg, _BLOOM_RENAMES, fused_layers=("transformer.h", "self_attention"),
        skip=("lm_head",),
    )


def _opt(hf_sd: dict, cfg: ModelConfig) -> dict:
    return _remap(hf_sd, cfg, _OPT_RENAMES, skip=("lm_head",))


def _phi(hf_sd: dict, cfg: ModelConfig) -> dict:
    return _remap(hf_sd, cfg, _PHI_RENAMES)


def _gpt2(hf_sd: dict, cfg: ModelConfig) -> dict:
    out = {}
    for key, value in hf_sd.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key.startswith("lm_head"):
            continue
        layer = key.replace("transformer.h", "layers")
        if "c_attn" in key:
            prefix, suffix = layer.split("attn.c_attn")[0], key.rsplit(".", 1)[1]
            parts = value.t().chunk(3, dim=0) if suffix == "weight" else value.chunk(3)
            for name, part in zip("qkv", parts, strict=True):
                out[f"{prefix}attn.w{name}.{suffix}"] = part
            continue
        new = layer.replace("transformer.wte", "tok_embeddings").replace(
            "transformer.wpe", "pos_embeddings"
        )
        new = (
            new.replace("transformer.ln_f", "norm")
            .replace("ln_1", "attn_norm")
            .replace("ln_2", "mlp_norm")
        )
        new = new.replace("attn.c_proj", "attn.wo").replace("mlp.c_fc", "mlp.w_up")
        new = new.replace("mlp.c_proj", "mlp.w_down")
        is_conv1d = any(s in key for s in ("c_proj.weight", "c_fc.weight"))
        out[new] = value.t() if is_conv1d else value
    return out


def _cases():
    t = transformers
    base = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS)
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    opt_hf = dict(**base, ffn_dim=128, num_attention_heads=4, max_position_embeddings=32)
    opt_dt = dict(
        vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=4, ffn_dim=128, max_seq_len=32,
        learned_pos_offset=2, norm_type="layernorm", norm_bias=True,
        position_embedding="learned", activation="relu", qkv_bias=True, attn_out_bias=True,
        mlp_bias=True, tie_embeddings=True,
    )
    return {
        "llama-gqa-llama3-rope": (
            lambda: t.LlamaForCausalLM(
                t.LlamaConfig(
                    **base,
                    intermediate_size=160,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    rope_parameters=llama3,
                    rms_norm_eps=1e-5,
                )
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=DIM,
                num_layers=LAYERS,
                num_heads=4,
                num_kv_heads=2,
                ffn_dim=160,
                rope_theta=500000.0,
                max_seq_len=64,
                rope_scaling={"factor": 8.0, "original_max_seq_len": 16},
            ),
            _llama_like,
        ),
        "qwen3-qknorm-headdim-mqa-tied": (
            lambda: t.Qwen3ForCausalLM(
                t.Qwen3Config(
                    **base,
                    intermediate_size=96,
                    num_attention_heads=4,
                    num_key_value_heads=1,
                    head_dim=32,
                    tie_word_embeddings=True,
                    rms_norm_eps=1e-6,
                    max_window_layers=LAYERS,
                )
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=DIM,
                num_layers=LAYERS,
                num_heads=4,
                num_kv_heads=1,
                head_dim=32,
                ffn_dim=96,
                qk_norm=True,
                tie_embeddings=True,
                norm_eps=1e-6,
                rope_theta=10000.0,
            ),
            _llama_like,
        ),
        "mistral-sliding-window": (
            lambda: t.MistralForCausalLM(
                t.MistralConfig(
                    **base,
                    intermediate_size=128,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    sliding_window=5,
                )
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=DIM,
                num_layers=LAYERS,
                num_heads=4,
                num_kv_heads=2,
                ffn_dim=128,
                sliding_window=5,
                norm_eps=1e-6,
            ),
            _llama_like,
        ),
        "neox-partial-rotary-parallel": (
            lambda: t.GPTNeoXForCausalLM(
                t.GPTNeoXConfig(
                    **base,
                    intermediate_size=256,
                    num_attention_heads=4,
                    rope_parameters={
                        "rope_theta": 10000.0,
                        "rope_type": "default",
                        "partial_rotary_factor": 0.25,
                    },
                    hidden_act="gelu",
                    use_parallel_residual=True,
                )
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=DIM,
                num_layers=LAYERS,
                num_heads=4,
                ffn_dim=256,
                norm_type="layernorm",
                norm_bias=True,
                rotary_fraction=0.25,
                activation="gelu",
                block_type="parallel",
                qkv_bias=True,
                attn_out_bias=True,
                mlp_bias=True,
            ),
            _neox,
        ),
        "bloom-alibi-6-heads": (
            lambda: t.BloomForCausalLM(
                t.BloomConfig(vocab_size=VOCAB, hidden_size=96, n_layer=LAYERS, n_head=6)
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=96,
                num_layers=LAYERS,
                num_heads=6,
                norm_type="layernorm",
                norm_bias=True,
                embedding_norm=True,
                position_embedding="alibi",
                activation="gelu_tanh",
                qkv_bias=True,
                attn_out_bias=True,
                mlp_bias=True,
                tie_embeddings=True,
            ),
            _bloom,
        ),
        "gpt2-learned-tied": (
            lambda: t.GPT2LMHeadModel(
                t.GPT2Config(vocab_size=VOCAB, n_embd=DIM, n_layer=LAYERS, n_head=4, n_positions=32)
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=DIM,
                num_layers=LAYERS,
                num_heads=4,
                max_seq_len=32,
                norm_type="layernorm",
                norm_bias=True,
                position_embedding="learned",
                activation="gelu_tanh",
                qkv_bias=True,
                attn_out_bias=True,
                mlp_bias=True,
                tie_embeddings=True,
            ),
            _gpt2,
        ),
        "opt-relu-offset": (
            lambda: t.OPTForCausalLM(
                t.OPTConfig(**opt_hf, word_embed_proj_dim=DIM)
            ),
            ModelConfig(**opt_dt),
            _opt,
        ),
        "opt-350m-post-norm-projections": (
            lambda: t.OPTForCausalLM(
                t.OPTConfig(**opt_hf, word_embed_proj_dim=32, do_layer_norm_before=False)
            ),
            ModelConfig(**opt_dt, embed_dim=32, norm_position="post", final_norm=False),
            _opt,
        ),
        "phi-parallel-shared-norm-head-bias": (
            lambda: t.PhiForCausalLM(
                t.PhiConfig(
                    **base,
                    intermediate_size=128,
                    num_attention_heads=4,
                    rope_parameters={
                        "rope_theta": 10000.0,
                        "rope_type": "default",
                        "partial_rotary_factor": 0.5,
                    },
                )
            ),
            ModelConfig(
                vocab_size=VOCAB,
                dim=DIM,
                num_layers=LAYERS,
                num_heads=4,
                ffn_dim=128,
                norm_type="layernorm",
                norm_bias=True,
                rotary_fraction=0.5,
                activation="gelu_tanh",
                block_type="parallel",
                parallel_shared_norm=True,
                qkv_bias=True,
                attn_out_bias=True,
                mlp_bias=True,
                lm_head_bias=True,
            ),
            _phi,
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_logits_match_transformers(case):
    torch.manual_seed(0)
    build_hf, cfg, convert = _cases()[case]
    hf_model = build_hf()
    hf_model.eval()
    with torch.no_grad():  # random norms and biases so that every parameter matters
        for name, param in hf_model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model = Transformer(cfg).eval()
    state = convert(hf_model.state_dict(), cfg)
    if cfg.tie_embeddings:
        state.pop("output.weight", None)  # transformers lists the tied head under its own name
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = model(tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
