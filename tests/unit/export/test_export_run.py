"""`densetrain export RUN --to-hf DIR` end to end: a trained run goes to a directory that
`transformers` loads on its own (tokenizer, model, generate), with densetrain's logits."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from densetrain.cli.main import main

transformers = pytest.importorskip("transformers")

PROMPT = "def main(argv):\n    "


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    run_dir, _ = trained_run
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", str(run_dir), "--to-hf", str(out)]) == 0
    return out


def test_export_is_self_contained_for_transformers(trained_run, exported):
    from densetrain.eval.loading import load_for_eval
    from densetrain.generate import generate

    run_dir, _ = trained_run
    names = sorted(p.name for p in exported.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors",
                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    ours, our_tokenizer = load_for_eval(run_dir, device="cpu")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager").eval()
    ids = our_tokenizer.encode(PROMPT)
    assert hf_tokenizer(PROMPT)["input_ids"] == ids
    assert hf_tokenizer.decode(ids) == our_tokenizer.decode(ids) == PROMPT
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        our_tokenizer.eos_id, our_tokenizer.pad_id)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        diff = (hf_model(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5
    with torch.no_grad():
        hf_out = hf_model.generate(**hf_tokenizer(PROMPT, return_tensors="pt"),
                                   max_new_tokens=12, do_sample=False)
        our_out = generate(ours, tokens, 12, eos_token_id=our_tokenizer.eos_id)
    assert hf_out[0].tolist() == our_out[0].tolist()


def test_config_has_special_ids_and_normal_permissions(exported):
    config = json.loads((exported / "config.json").read_text())
    generation = json.loads((exported / "generation_config.json").read_text())
    tokenizer = json.loads((exported / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    for key, token in (("bos", "<|bos|>"), ("eos", "<|eos|>"), ("pad", "<|pad|>")):
        assert config[f"{key}_token_id"] == generation[f"{key}_token_id"] == vocab[token]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(exported.stat().st_mode) == 0o777 & ~umask
    for path in exported.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


def test_convert_to_hf_is_the_same_export(trained_run, exported, tmp_path, capsys):
    run_dir, _ = trained_run
    checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert main(["convert", "--to-hf", str(checkpoint), "--out", str(tmp_path / "c")]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "c" / name).read_bytes() == (exported / name).read_bytes()


def test_missing_tokenizer_is_one_clear_error(trained_run, exported, tmp_path, capsys):
    run_dir, cache = trained_run
    checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
    gone = cache.with_name(cache.name + "-cleared")
    os.replace(cache, gone)  # the default-corpus cache the run trained from is cleared
    try:
        assert main(["export", str(checkpoint), "--to-hf", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert str(cache) in err and "--tokenizer" in err and "Traceback" not in err
        assert not (tmp_path / "out").exists()
        # With the tokenizer named explicitly the same checkpoint exports.
        assert main(["export", str(checkpoint), "--to-hf", str(tmp_path / "out"),
                     "--tokenizer", str(exported / "tokenizer.json")]) == 0
    finally:
        os.replace(gone, cache)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        exported / "tokenizer.json").read_bytes()


def test_not_a_run_is_one_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--to-hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and "Traceback" not in err
