"""Packing several segments into one row (document masking) gives the scores of running each
segment alone, for every position scheme; errors name the problem."""

from __future__ import annotations

import pytest
import torch

from densetrain.eval.scoring import LogLikelihoodScorer, Segment
from densetrain.models import ModelConfig, Transformer

VOCAB = 101
CASES = {
    "rope-gqa": {},
    "learned-positions": dict(position_embedding="learned", norm_type="layernorm"),
    "alibi": dict(position_embedding="alibi", num_kv_heads=4),
    "sliding-window": dict(sliding_window=5),
}


def _model(**changes) -> Transformer:
    fields = dict(vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_dim=96, max_seq_len=32)
    fields.update(changes)
    model = Transformer(ModelConfig(**fields))
    model.init_weights(seed=1)
    with torch.no_grad():
        model.output_weight().mul_(10)  # log-probs far from uniform
    return model.eval()


def _alone(model: Transformer, segment: Segment) -> tuple[float, bool]:
    ids = torch.tensor([list(segment.tokens)])
    with torch.no_grad():
        logits = model(ids[:, :-1])[0, -segment.num_scored :].double()
    targets = ids[0, 1:][-segment.num_scored :]
    logprobs = logits.log_softmax(-1).gather(1, targets.unsqueeze(1))
    return float(logprobs.sum()), bool((logits.argmax(-1) == targets).all())


@pytest.mark.parametrize("name", list(CASES))
def test_packed_rows_equal_segments_scored_alone(name):
    model = _model(**CASES[name])
    generator = torch.Generator().manual_seed(0)
    segments = []
    for length in (3, 9, 17, 2, 32, 6, 11, 4):
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator).tolist()
        segments.append(Segment(tokens=tokens, num_scored=max(1, length // 2)))
    scores = LogLikelihoodScorer(model, batch_size=2).score_all(segments)
    assert len(scores) == len(segments)
    for segment, score in zip(segments, scores, strict=True):
        logprob, greedy = _alone(model, segment)
        assert score.logprob == pytest.approx(logprob, rel=1e-5, abs=1e-4)
        assert score.num_tokens == segment.num_scored
        assert score.is_greedy == greedy


def test_greedy_flag_on_a_segment_made_of_argmax_tokens():
    model = _model()
    tokens = [5]
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    (score,) = LogLikelihoodScorer(model).score_all([Segment(tokens=tokens, num_scored=6)])
    assert score.is_greedy


def test_errors():
    model = _model()
    with pytest.raises(ValueError, match="num_scored must be in"):
        Segment(tokens=[1, 2], num_scored=2)
    with pytest.raises(ValueError, match="longer than max_len 32"):
        LogLikelihoodScorer(model).score_all([Segment(tokens=list(range(40)), num_scored=1)])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        LogLikelihoodScorer(model).score_all([Segment(tokens=[1, VOCAB], num_scored=1)])
    learned = _model(position_embedding="learned", norm_type="layernorm")
    with pytest.raises(ValueError, match="learned positions"):
        LogLikelihoodScorer(learned, max_len=64)
