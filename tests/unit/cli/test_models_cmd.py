"""`densetrain convert` and `densetrain model-info`, run in-process through the real parser."""

from __future__ import annotations

import json

import pytest
import torch

from densetrain.cli.main import main
from densetrain.models import ModelConfig, Transformer, get_preset
from densetrain.models.hf import load_model

transformers = pytest.importorskip("transformers")


def _meta_numel(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


def test_model_info_json_matches_model_and_published_formulas(capsys):
    assert main(["model-info", "llama2-7b", "--json", "--seq-len", "2048"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = get_preset("llama2-7b")
    total = _meta_numel(cfg)
    assert info["total_params"] == total
    token_embedding = cfg.vocab_size * cfg.dim
    # Untied: the embedding counts both the token table and the output matrix (Kaplan §2.1).
    assert info["non_embedding_params"] == total - 2 * token_embedding
    # PaLM Appendix B: 6N + 12·L·H·Q·T, N counting the output projection but not the lookup.
    palm = 6 * (total - token_embedding) + 12 * 32 * 32 * 128 * 2048
    assert info["flops_per_token_palm"] == pytest.approx(palm)
    assert info["flops_per_token_chinchilla"] > 0
    # Keys and values, every layer, all kv heads, bf16.
    assert info["kv_cache_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * 128 * 2


def test_model_info_text_and_gqa_kv_bytes(capsys):
    assert main(["model-info", "llama2-70b", "--kv-bytes", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{_meta_numel(get_preset('llama2-70b')):,}" in out
    assert f"{2 * 80 * 8 * 128:,} bytes" in out


def test_model_info_unknown_preset_lists_close_names(capsys):
    assert main(["model-info", "opt-350"]) == 2
    assert "opt-350m" in capsys.readouterr().err


def _tiny_hf(directory, config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.eval().save_pretrained(directory)
    return model


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        ),
        transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        ),
    ],
    ids=["llama", "gpt2"],
)
@torch.no_grad()
def test_convert_from_hf_and_back(tmp_path, capsys, config):
    hf_model = _tiny_hf(tmp_path / "hf", config)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dt")]) == 0
    saved_config = json.loads((tmp_path / "dt" / "config.json").read_text())
    assert ModelConfig.from_dict(saved_config).dim == 32
    assert (tmp_path / "dt" / "model.safetensors").is_file()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = hf_model(tokens).logits
    model = load_model(tmp_path / "dt")
    assert (model(tokens) - expected).abs().max().item() <= 1e-4
    assert "converted" in capsys.readouterr().out
    assert main(["model-info", str(tmp_path / "dt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == sum(p.numel() for p in model.parameters())

    assert main(["convert", "--to-hf", str(tmp_path / "dt"), "--out", str(tmp_path / "back"),
                 "--no-tokenizer"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    ).eval()
    assert torch.equal(reloaded(tokens).logits, expected)
    assert "exported" in capsys.readouterr().out


def test_convert_refuses_unexpressible_family_without_writing(tmp_path, capsys):
    _tiny_hf(
        tmp_path / "hf",
        transformers.Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=32,
        ),
    )
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dt")]) == 0
    out = tmp_path / "as_gpt2"
    assert main(["convert", "--to-hf", str(tmp_path / "dt"), "--out", str(out),
                 "--family", "gpt2", "--no-tokenizer"]) == 2
    assert "qk_norm" in capsys.readouterr().err
    assert not out.exists()


def test_convert_unsupported_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert main(["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'mamba'" in err and "llama" in err


def test_model_info_and_presets_answer_without_torch():
    """`model-info PRESET` and `presets` read configs and formulas only: torch is never
    imported (seconds of start-up), yet ``densetrain.models.Transformer`` still imports after."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from densetrain.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert main(['model-info', 'llama3-8b', '--json']) == 0\n"
        "    assert main(['presets', '--family', 'llama']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert '8030261248' in out.getvalue()\n"
        "from densetrain.models import Transformer, chunked_lm_loss\n"
        "assert 'torch' in sys.modules and Transformer.__name__ == 'Transformer'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
