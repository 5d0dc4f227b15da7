"""Shared fixtures of the evaluation tests: a small byte-level BPE tokenizer and a tiny random
`transformers` Llama imported into densetrain (the independent reference)."""

from __future__ import annotations

import shutil

import pytest
import torch

from densetrain.data.default_corpus import stdlib_files
from densetrain.data.tokenizer import load_tokenizer, train_tokenizer

MAX_POSITIONS = 64


def corpus_texts(count: int = 6) -> list[str]:
    """The first ``count`` standard-library sources (what the default corpus is made of)."""
    return [path.read_text(encoding="utf-8") for path in stdlib_files(max_files=count)]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A 320-token byte-level BPE trained on a few standard-library files."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(corpus_texts(), path, vocab_size=320)
    return load_tokenizer(path)


@pytest.fixture(scope="session")
def hf_pair(tokenizer, tmp_path_factory):
    """(transformers model, the same weights loaded by densetrain, its directory)."""
    transformers = pytest.importorskip("transformers")
    from densetrain.models.hf import load_hf

    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for param in hf_model.parameters():  # sharpen: log-probs far from uniform
            param.add_(torch.randn_like(param) * 0.2)
    hf_model.eval()
    directory = tmp_path_factory.mktemp("hf") / "model"
    hf_model.save_pretrained(directory)
    shutil.copyfile(tokenizer.path, directory / "tokenizer.json")
    return hf_model, load_hf(directory).eval(), directory


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from the `transformers` model (fp64 log-softmax)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
