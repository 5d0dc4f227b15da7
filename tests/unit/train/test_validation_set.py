"""In-run validation takes a fixed set of windows of the validation split: the same tokens and
the same loss whatever ``data.seed``, the batch size or the number of data-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from densetrain.testing import run_distributed
from densetrain.train.evaluation import Evaluator, validation_set
from densetrain.train.setup import build_run

WINDOWS = 7  # not a multiple of any batch below: the last batches carry padding rows


def _reference_val_loss(parts, num_windows: int) -> float:
    """Sum of the token losses of the evenly spaced windows over their token count, computed
    from the validation stores and the model's logits directly."""
    stream = parts.data.val
    S = stream.seq_len
    spans = [(store, (store.num_tokens - 1) // S) for store in stream.stores]
    total = sum(n for _, n in spans)
    picks = [int((j + 0.5) * total / num_windows) for j in range(num_windows)]
    model = parts.model.module
    loss_sum, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for pick in picks:
            source = 0
            while pick >= spans[source][1]:
                pick -= spans[source][1]
                source += 1
            store = spans[source][0]
            window = torch.from_numpy(store.read(pick * S, S + 1).astype("int64"))
            logits = model(window[None, :-1]).float()
            loss_sum += F.cross_entropy(logits[0], window[1:], reduction="sum").item()
            count += S
    model.train()
    return loss_sum / count


def _val_loss(job) -> tuple[float, dict]:
    parts, _ = build_run(job)
    result = Evaluator(interval=1, num_windows=WINDOWS).evaluate(parts)
    return result["val_loss"], result


def test_val_loss_is_the_same_tokens_for_any_seed_and_batch_size(make_job) -> None:
    first = make_job("--data.seed=1337", "--training.global_batch_size=8",
                     "--training.micro_batch_size=4", run="a")
    parts, _ = build_run(first)
    reference = _reference_val_loss(parts, WINDOWS)
    evaluated = Evaluator(interval=1, num_windows=WINDOWS).evaluate(parts)
    assert evaluated["val_loss"] == pytest.approx(reference, rel=1e-5)
    assert evaluated["val_windows"] == WINDOWS
    assert evaluated["val_tokens"] == WINDOWS * first.data.seq_len
    for overrides in (("--data.seed=1", "--training.global_batch_size=8",
                       "--training.micro_batch_size=4"),
                      ("--data.seed=1", "--training.global_batch_size=4",
                       "--training.micro_batch_size=2"),
                      ("--data.seed=99", "--training.global_batch_size=16",
                       "--training.micro_batch_size=16")):
        other_loss, other = _val_loss(make_job(*overrides, run="b" + overrides[1][-2:]))
        assert other_loss == pytest.approx(evaluated["val_loss"], rel=1e-6)
        assert other["val_set"] == evaluated["val_set"]


def test_the_set_is_spread_over_the_split_and_zero_takes_it_whole(make_job) -> None:
    parts, _ = build_run(make_job())
    stream = parts.data.val
    total = sum(stream.num_sequences)
    whole = validation_set(stream, 0)
    assert len(whole.windows) == total == len(validation_set(stream, total + 5).windows)
    some = validation_set(stream, 4)
    assert len(set(some.windows)) == 4 and some.key != whole.key
    shares = [some.rank_slice(rank, 3) for rank in range(3)]
    assert sum(shares, []) == some.windows
    with pytest.raises(ValueError, match="eval.num_windows"):
        validation_set(stream, -1)


def test_num_windows_out_of_range_names_the_field(make_job) -> None:
    with pytest.raises(ValueError, match="eval.num_windows must be an integer >= 0"):
        make_job("--eval.num_windows=-3")


def _val_loss_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    parts, _ = build_run(load_job_config(None, overrides))
    return Evaluator(interval=1, num_windows=WINDOWS).evaluate(parts)


def test_two_data_parallel_ranks_evaluate_the_same_windows(make_job, tiny_overrides,
                                                           tmp_path) -> None:
    single = make_job("--training.global_batch_size=4", "--training.micro_batch_size=2",
                      run="single")
    one, one_result = _val_loss(single)
    overrides = tiny_overrides + [
        f"--data.cache_dir={single.data.cache_dir}", f"--logging.run_dir={tmp_path / 'two'}",
        "--parallel.dp_shard=2", "--data.seed=5",
    ]
    results = run_distributed(_val_loss_on_rank, 2, overrides, timeout=240)
    assert results[0]["val_loss"] == results[1]["val_loss"]
    assert results[0]["val_loss"] == pytest.approx(one, rel=1e-5)
    assert results[0]["val_set"] == one_result["val_set"]
