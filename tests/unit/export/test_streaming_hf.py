"""Tensor-by-tensor Hugging Face export: the streamed tensors equal the whole-state mapping of
every family, and the hand-written safetensors stream reads back through safetensors itself."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from densetrain.models import get_preset
from densetrain.models.hf import get_adapter
from densetrain.models.hf.files import (
    StreamingSafetensorsWriter,
    TensorSpec,
    checkpoint_files,
    write_directory_atomically,
)
from densetrain.models.hf.shapes import dt_param_shapes
from densetrain.models.hf.streaming import export_groups, iter_hf_tensors

FAMILY_PRESETS = {  # one preset per exported family (phi-1 shrunk below)
    "gpt2": "tiny-gpt2", "llama": "tiny-llama", "mistral": "tiny-mistral",
    "qwen3": "tiny-qwen3", "gpt_neox": "tiny-neox", "opt": "tiny-opt", "bloom": "tiny-bloom",
    "phi": "phi-1",
}


def _config(family: str):
    cfg = get_preset(FAMILY_PRESETS[family])
    if family == "phi":
        cfg = cfg.replace(vocab_size=96, dim=32, embed_dim=32, num_layers=2, num_heads=4,
                          num_kv_heads=4, head_dim=8, ffn_dim=64, max_seq_len=64)
    return cfg


@pytest.mark.parametrize("family", sorted(FAMILY_PRESETS))
def test_streamed_tensors_equal_whole_state_mapping(family):
    cfg = _config(family)
    adapter = get_adapter(family)
    generator = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=generator) for n, s in dt_param_shapes(cfg).items()}
    expected = adapter.dt_to_hf(state, cfg)
    reads: list[tuple[str, ...]] = []

    def read(names):
        reads.append(names)
        return {name: state[name] for name in names}

    streamed = dict(iter_hf_tensors(cfg, adapter, read))
    assert streamed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(streamed[name], tensor), name
    # Every parameter is read exactly once, and a read never spans more than one fused tensor.
    flat = [name for names in reads for name in names]
    assert sorted(flat) == sorted(state)
    assert max(len(names) for names in reads) <= 3


def test_groups_are_the_fused_inputs():
    cfg = _config("gpt2")
    groups = {g.hf_names: g.dt_names for g in export_groups(cfg, get_adapter("gpt2"))}
    assert groups[("transformer.h.0.attn.c_attn.weight",)] == tuple(
        f"layers.0.attn.{w}.weight" for w in ("wq", "wk", "wv"))
    assert groups[("transformer.ln_f.weight",)] == ("norm.weight",)


def test_streaming_writer_round_trips_in_any_order_and_shards(tmp_path):
    generator = torch.Generator().manual_seed(1)
    tensors = {
        "a": torch.randn(3, 5, generator=generator),
        "b": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c": torch.randn(2, 2, 2, generator=generator),
    }
    specs = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}
    with StreamingSafetensorsWriter(tmp_path, specs, max_shard_bytes=64) as writer:
        for name in ("c", "a", "b"):
            writer.write(name, tensors[name])
    files = checkpoint_files(tmp_path)
    assert len(set(files.values())) == 2  # 60 + 14 + 32 bytes over 64-byte shards
    loaded = {}
    for path in set(files.values()):
        loaded.update(load_file(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with safe_open(files["a"], framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_streaming_writer_refuses_wrong_or_missing_tensors(tmp_path):
    specs = {"a": TensorSpec((2,), torch.float32), "b": TensorSpec((2,), torch.float32)}
    writer = StreamingSafetensorsWriter(tmp_path, specs, max_shard_bytes=10**9)
    with pytest.raises(ValueError, match=r"expected \[2\] torch.float32"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="not in the checkpoint plan"):
        writer.write("z", torch.zeros(2))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="already written"):
        writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match=r"never written: \['b'\]"):
        writer.close()


def test_atomic_directory_has_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        def fill(directory):
            (directory / "x.json").write_text(json.dumps({}))
        write_directory_atomically(tmp_path / "out", fill)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "out" / "x.json").stat().st_mode) == 0o640
