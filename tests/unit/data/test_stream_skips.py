"""Skipped ranges of the global sequence order: batches read around them, on any rank count."""

from __future__ import annotations

import pytest
import torch

from densetrain.data import BatchStream, TokenStore


def _stream(prepared, *, rank=0, size=1):
    return BatchStream([TokenStore(prepared, "train")], [1.0], seq_len=32, seed=3,
                       dp_rank=rank, dp_size=size)


def test_batches_skip_the_ranges_and_equal_the_unskipped_order(prepared):
    reference = _stream(prepared)
    stream = _stream(prepared)
    stream.set_skip_ranges([(16, 24), (8, 12)])  # the second overlaps the batch [8, 16)
    starts = []
    for _ in range(3):
        starts.append(stream.next_start(8))
        batch = stream.next_batch(8)
        assert torch.equal(batch.inputs, reference.batch_at(starts[-1], 8).inputs)
    assert starts == [0, 24, 32]  # [8, 16) overlaps (8, 12), [16, 24) is skipped
    assert stream.consumed_sequences == 40


def test_skips_are_the_same_on_two_ranks(prepared):
    single = _stream(prepared)
    single.set_skip_ranges([(8, 24)])
    ranks = [_stream(prepared, rank=r, size=2) for r in range(2)]
    for stream in ranks:
        stream.set_skip_ranges([(8, 24)])
    for _ in range(3):
        whole = single.next_batch(8).inputs
        halves = torch.cat([s.next_batch(8).inputs for s in ranks])
        assert torch.equal(whole, halves)


def test_ranges_are_merged_and_checked(prepared):
    stream = _stream(prepared)
    stream.set_skip_ranges([(10, 20), (0, 5), (15, 30)])
    assert stream.skip_ranges == [(0, 5), (10, 30)]
    with pytest.raises(ValueError, match="0 <= start < end"):
        stream.set_skip_ranges([(5, 5)])
