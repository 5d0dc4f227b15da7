"""The lm-evaluation-harness adapter on plain objects shaped like harness requests (``.args``);
`lm_eval` itself is not imported."""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from conftest import hf_logprobs

from densetrain.eval.lm_eval_adapter import HarnessAdapter, make_lm_eval_model
from densetrain.eval.perplexity import PerplexityConfig, text_perplexity


def request(*args):
    return SimpleNamespace(args=args)


def test_loglikelihood_matches_transformers(hf_pair, tokenizer):
    hf_model, model, _ = hf_pair
    adapter = HarnessAdapter(model, tokenizer)
    (logprob, greedy), = adapter.loglikelihood([request("import", " os")])
    context_ids = tokenizer.encode("import")
    ids = tokenizer.encode("import os")
    expected = hf_logprobs(hf_model, ids)[len(context_ids) - 1 :].sum()
    assert logprob == pytest.approx(float(expected), rel=1e-5)
    assert isinstance(greedy, bool)


def test_loglikelihood_rolling_is_the_document_loglikelihood(hf_pair, tokenizer):
    hf_model, model, _ = hf_pair
    short, long = "x = 1\n", "value = compute(x)\n" * 12
    adapter = HarnessAdapter(model, tokenizer, batch_size=2)
    rolled = adapter.loglikelihood_rolling([request(short), request(long)])
    expected_short = hf_logprobs(hf_model, [tokenizer.eos_id, *tokenizer.encode(short)]).sum()
    assert rolled[0] == pytest.approx(float(expected_short), rel=1e-5)
    assert len(tokenizer.encode(long)) > adapter.max_length  # several windows
    nats = text_perplexity(model, tokenizer, [long], PerplexityConfig()).nats
    assert rolled[1] == pytest.approx(-nats, rel=1e-6)


def _hf_greedy(hf_model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        for _ in range(steps):
            ids = [*ids, int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids


def test_generate_until_is_greedy_and_stops_at_the_first_stop_string(hf_pair, tokenizer):
    hf_model, model = (copy.deepcopy(m) for m in hf_pair[:2])
    with torch.no_grad():  # sharpen both copies alike: greedy choices far from ties
        hf_model.lm_head.weight.mul_(10)
        model.output.weight.mul_(10)
    context = "def f(x):\n"
    ids = tokenizer.encode(context)
    reference_ids = _hf_greedy(hf_model, ids, 12)[len(ids):]
    if tokenizer.eos_id in reference_ids:
        reference_ids = reference_ids[: reference_ids.index(tokenizer.eos_id)]
    reference = tokenizer.decode(reference_ids)
    adapter = HarnessAdapter(model, tokenizer)
    full, = adapter.generate_until([request(context, {"max_gen_toks": 12, "until": []})])
    assert full == reference
    stop = reference[2:4]
    cut, = adapter.generate_until([request(context, {"max_gen_toks": 12, "until": [stop]})])
    assert cut == reference[: reference.index(stop)]
    with pytest.raises(ValueError, match="unsupported gen_kwargs"):
        adapter.generate_until([request(context, {"beams": 4})])


def test_malformed_request_is_named(hf_pair, tokenizer):
    _, model, _ = hf_pair
    with pytest.raises(ValueError, match="loglikelihood request needs .args with 2 entries"):
        HarnessAdapter(model, tokenizer).loglikelihood([request("only context")])


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None, reason="lm_eval installed")
def test_without_lm_eval_the_wrapper_says_how_to_install(hf_pair, tokenizer):
    _, model, _ = hf_pair
    with pytest.raises(ImportError, match="pip install lm-eval"):
        make_lm_eval_model(model, tokenizer)
