"""Bad model files are refused with one line naming the file and the field, tensor or key:
a densetrain model directory's config.json and tensors, a Hugging Face config.json (by its own
key names), tensor dtypes, a sharded checkpoint's index, and what `model-info` accepts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from densetrain.cli.main import main
from densetrain.errors import UserError
from densetrain.models import ModelConfig, Transformer
from densetrain.models.hf import config_to_hf, load_hf, load_model, save_hf, save_model
from densetrain.models.presets import get_preset

CFG = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48,
           max_seq_len=32, extra={"family": "llama", "hf_family": "llama"})


@pytest.fixture()
def model(tmp_path) -> Transformer:
    model = Transformer(ModelConfig(**CFG))
    model.init_weights()
    return model


@pytest.fixture()
def model_dir(tmp_path, model):
    save_model(model, tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture()
def hf_dir(tmp_path, model):
    save_hf(model, tmp_path / "hf")
    return tmp_path / "hf"


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _cli_error(argv, capsys) -> str:
    """The one stderr line of a command that must exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ densetrain config.json
def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _del(key):
    return lambda d: d.pop(key)


@pytest.mark.parametrize("edit,message", [
    (_del("dim"), "required ModelConfig field(s) dim missing"),
    (_del("num_layers"), "required ModelConfig field(s) num_layers missing"),
    (_del("vocab_size"), "required ModelConfig field(s) vocab_size missing"),
    (_set("rope_scaling", {"factor": "x"}), "rope_scaling.factor expects a number, got the "
                                            "string 'x'"),
    (_set("rope_scaling", {"factr": 2.0}), "unknown key 'rope_scaling.factr' in [rope_scaling]; "
                                           "did you mean 'factor'?"),
    (_set("extra", 5), "extra expects an object ({...}), got 5"),
    (_set("activation", "relu6"), "activation must be one of"),
    (_set("num_layers", "4"), "num_layers expects an integer, got the string '4'"),
    (_set("tie_embeddings", "false"), "tie_embeddings expects a boolean"),
    (_set("bogus", 1), "unknown key 'bogus' in ModelConfig"),
    (_set("num_layerz", 2), "did you mean 'num_layers'?"),
], ids=["no-dim", "no-num_layers", "no-vocab_size", "rope-factor-string", "rope-unknown-key",
        "extra-int", "activation", "int-as-string", "bool-as-string", "unknown", "typo"])
def test_model_dir_config_errors_name_file_and_field(model_dir, capsys, edit, message):
    config = model_dir / "config.json"
    _edit_json(config, edit)
    with pytest.raises(UserError) as caught:
        load_model(model_dir)
    assert str(caught.value).startswith(f"{config}: ")
    assert message in str(caught.value)
    err = _cli_error(["model-info", str(model_dir)], capsys)
    assert f"{config}: " in err and message in err


def test_model_dir_tensor_shapes_are_checked_against_config_in_one_line(model_dir, capsys):
    _edit_json(model_dir / "config.json", _del("ffn_dim"))  # derived again: 4 * dim = 128
    with pytest.raises(UserError) as caught:
        load_model(model_dir)
    message = str(caught.value)
    assert "\n" not in message
    assert "layers.0.mlp.w_down.weight: expected [32, 128], found [32, 48]" in message
    assert "size mismatch" not in message
    _edit_json(model_dir / "config.json", lambda d: d.update(ffn_dim=48, num_layers=3))
    assert "missing tensors layers.2." in _cli_error(["model-info", str(model_dir)], capsys)


# ------------------------------------------------------------------ dtypes
def _retype(path, name, dtype) -> None:
    tensors = load_file(path)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_mixed_float_dtypes_load_as_one_dtype(model_dir, hf_dir, tmp_path, capsys):
    _retype(model_dir / "model.safetensors", "layers.0.mlp.w_up.weight", torch.float16)
    model = load_model(model_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model(torch.zeros(1, 4, dtype=torch.long))  # before: "expected m1 and m2 ... same dtype"

    _retype(hf_dir / "model.safetensors", "model.layers.0.mlp.up_proj.weight", torch.bfloat16)
    assert {p.dtype for p in load_hf(hf_dir).parameters()} == {torch.float32}
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "c")]) == 0
    assert "float32" in capsys.readouterr().out
    stored = load_file(tmp_path / "c" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.float32}
    # f16 beside bf16: neither holds the other, so both load as float32
    _retype(hf_dir / "model.safetensors", "model.norm.weight", torch.float16)
    assert {p.dtype for p in load_hf(hf_dir).parameters()} == {torch.float32}


def test_integer_tensor_is_refused_naming_it(model_dir, hf_dir, tmp_path, capsys):
    _retype(model_dir / "model.safetensors", "layers.1.attn.wq.weight", torch.int32)
    with pytest.raises(UserError, match=r"tensor 'layers\.1\.attn\.wq\.weight' is stored as "
                                        r"I32; model weights must be floating point"):
        load_model(model_dir)
    _retype(hf_dir / "model.safetensors", "model.embed_tokens.weight", torch.int32)
    err = _cli_error(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "c")], capsys)
    assert "'model.embed_tokens.weight' is stored as I32" in err
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ Hugging Face config.json
def _hf_config_dir(tmp_path, preset, family, edit):
    hf = config_to_hf(get_preset(preset), family)
    edit(hf)
    directory = tmp_path / family
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


@pytest.mark.parametrize("preset,family,edit,message", [
    ("llama-13b", "llama", _set("hidden_size", "128"),
     "hidden_size must be a positive integer, got '128'"),
    ("llama-13b", "llama", _set("num_attention_heads", 0),
     "num_attention_heads must be a positive integer, got 0"),
    ("llama-13b", "llama", _set("num_attention_heads", None),
     "num_attention_heads must be a positive integer, got None"),
    ("llama-13b", "llama", _set("rms_norm_eps", -1), "rms_norm_eps must be a number > 0, got -1"),
    ("llama-13b", "llama", lambda d: (d.pop("rope_parameters"), d.update(rope_theta="abc")),
     "rope_theta must be a number > 0, got 'abc'"),
    ("llama-13b", "llama", lambda d: d["rope_parameters"].update(rope_theta="abc"),
     "rope_parameters.rope_theta must be a number > 0, got 'abc'"),
    ("llama-13b", "llama", _set("tie_word_embeddings", "false"),
     "tie_word_embeddings must be true or false (a JSON boolean), got 'false'"),
    ("llama-13b", "llama", _set("num_key_value_heads", 3),
     "num_kv_heads (3) must divide num_heads (40); allowed: any divisor (1 = MQA, num_heads = "
     "MHA) (densetrain's names: num_heads is num_attention_heads, num_kv_heads is "
     "num_key_value_heads in config.json)"),
    ("llama-13b", "llama", _set("architectures", "LlamaForCausalLM"),
     "architectures must be a list of class names"),
    ("mistral-7b", "mistral", _set("sliding_window", "4096"),
     "sliding_window must be a positive integer, got '4096'"),
    ("qwen3-0.6b", "qwen3", _set("use_sliding_window", "no"),
     "use_sliding_window must be true or false"),
    ("gpt2-1.5b", "gpt2", _set("n_embd", 1600.0), "n_embd must be a positive integer, got 1600.0"),
    ("gpt2-1.5b", "gpt2", _set("activation_function", ["gelu"]),
     "activation_function must be a string"),
    ("gpt-neox-20b", "gpt_neox", _set("layer_norm_eps", "1e-5"),
     "layer_norm_eps must be a number > 0, got '1e-5'"),
    ("gpt-neox-20b", "gpt_neox", _set("use_parallel_residual", 1),
     "use_parallel_residual must be true or false"),
    ("opt-1.3b", "opt", _set("ffn_dim", 0), "ffn_dim must be a positive integer, got 0"),
    ("opt-1.3b", "opt", _set("do_layer_norm_before", "true"),
     "do_layer_norm_before must be true or false"),
    ("bloom-1.1b", "bloom", _set("n_head", None), "n_head must be a positive integer, got None"),
    ("phi-1", "phi", _set("num_hidden_layers", True),
     "num_hidden_layers must be a positive integer, got True"),
    ("phi-1", "phi", lambda d: d["rope_parameters"].update(partial_rotary_factor=2.0),
     "rotary_fraction must be in (0, 1], got 2.0 (densetrain's names: rotary_fraction is "
     "partial_rotary_factor in config.json)"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_hf_config_errors_name_file_and_hf_key(tmp_path, preset, family, edit, message):
    directory = _hf_config_dir(tmp_path, preset, family, edit)
    with pytest.raises(UserError) as caught:
        load_hf(directory)  # the config is read (and refused) before any tensor
    assert str(caught.value).startswith(f"{directory / 'config.json'}: ")
    assert message in str(caught.value)


def test_hf_config_missing_nested_rope_key_is_named(tmp_path):
    directory = _hf_config_dir(tmp_path, "llama-13b", "llama", _set(
        "rope_parameters", {"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(UserError, match=r"config\.json has no field "
                                        r"'rope_parameters\.low_freq_factor'"):
        load_hf(directory)  # the config is read (and refused) before any tensor


def test_convert_names_the_hf_key(hf_dir, tmp_path, capsys):
    _edit_json(hf_dir / "config.json", _set("hidden_size", "32"))
    err = _cli_error(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "c")], capsys)
    assert f"{hf_dir / 'config.json'}: hidden_size must be a positive integer, got '32'" in err
    err = _cli_error(["model-info", str(hf_dir)], capsys)
    assert "hidden_size must be a positive integer" in err


def test_string_false_tie_word_embeddings_is_not_read_as_true(hf_dir, tmp_path, capsys):
    _edit_json(hf_dir / "config.json", _set("tie_word_embeddings", "false"))
    err = _cli_error(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "c")], capsys)
    assert "tie_word_embeddings must be true or false (a JSON boolean), got 'false'" in err


# ------------------------------------------------------------------ sharded index
def _shard(hf_dir, value_for_one) -> tuple:
    """Rewrite hf_dir as a one-shard sharded checkpoint whose index maps one tensor to
    ``value_for_one``; return (index path, that tensor's name)."""
    tensors = load_file(hf_dir / "model.safetensors")
    (hf_dir / "model.safetensors").unlink()
    shard = "model-00001-of-00001.safetensors"
    save_file(tensors, hf_dir / shard, metadata={"format": "pt"})
    name = sorted(tensors)[0]
    weight_map = {key: shard for key in tensors} | {name: value_for_one}
    index = hf_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index, name


@pytest.mark.parametrize("value", [5, None, "", "..", "../other/model.safetensors",
                                   "sub/model.safetensors", "ABS"])
def test_index_values_must_be_file_names_in_the_directory(hf_dir, tmp_path, value):
    other = tmp_path / "other"
    other.mkdir()
    os.link(hf_dir / "model.safetensors", other / "model.safetensors")  # a readable file outside
    if value == "ABS":
        value = str(other / "model.safetensors")
    index, name = _shard(hf_dir, value)
    with pytest.raises(UserError) as caught:
        load_hf(hf_dir)
    assert str(caught.value).startswith(f"{index}: weight_map[{name!r}] is {value!r}; each value "
                                        "must be the plain name of a safetensors file")


def test_index_naming_a_missing_shard_names_the_key(hf_dir):
    index, name = _shard(hf_dir, "model-00002-of-00002.safetensors")
    with pytest.raises(UserError, match=rf"{index}: weight_map\['{name}'\] names shard "
                                        r"model-00002-of-00002\.safetensors, which does not"):
        load_hf(hf_dir)


# ------------------------------------------------------------------ model-info arguments
def test_model_info_says_what_it_accepts_for_paths(tmp_path, capsys, model_dir):
    run = tmp_path / "run1"
    (run / "checkpoints" / "step-00000006").mkdir(parents=True)
    (run / "checkpoints" / "step-00000006" / "config.toml").write_text("")
    (run / "summary.json").write_text("{}")
    accepts = "model-info takes a preset name"
    err = _cli_error(["model-info", str(run)], capsys)
    assert "is a training run directory" in err and accepts in err and "densetrain export" in err
    err = _cli_error(["model-info", str(run / "checkpoints" / "step-00000006")], capsys)
    assert "is a training checkpoint directory" in err and accepts in err
    err = _cli_error(["model-info", str(run / "summary.json")], capsys)
    assert "is a file, not a directory" in err and accepts in err
    err = _cli_error(["model-info", str(tmp_path / "nonexistent")], capsys)
    assert "does not exist" in err and accepts in err
    assert "unknown model preset" not in err
    (tmp_path / "empty").mkdir()
    assert "directory without config.json" in _cli_error(
        ["model-info", str(tmp_path / "empty")], capsys)
    # a model directory's config.json itself is read too
    assert main(["model-info", str(model_dir / "config.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["dim"] == 32


@pytest.mark.parametrize("value", ["0", "-1"])
def test_model_info_kv_bytes_names_the_flag(capsys, value):
    err = _cli_error(["model-info", "llama2-7b", "--kv-bytes", value], capsys)
    assert "--kv-bytes must be a positive integer" in err and f"got {value}" in err
