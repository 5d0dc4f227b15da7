"""Packed batches: rank-count independence, exact resume, mixtures, document info, errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from densetrain.data import BatchStream, DataConfig, RepetitionWarning, TokenStore, build_data
from densetrain.data.sampler import BLOCK, apportion, permute


def _stream(prepared, *, rank=0, size=1, seq_len=32, seed=3, masking=False, weights=None):
    stores = [TokenStore(prepared, "train")] * (len(weights) if weights else 1)
    return BatchStream(
        stores,
        weights or [1.0],
        seq_len=seq_len,
        seed=seed,
        dp_rank=rank,
        dp_size=size,
        document_masking=masking,
        names=[f"src{i}" for i in range(len(stores))],
        max_epochs_warning=1e9 if weights else 4.0,
    )


def _global_batch(prepared, step_sizes, size, **kw):
    """Concatenate the rank slices of each global batch, reading ranks 0..size-1 separately."""
    streams = [_stream(prepared, rank=r, size=size, **kw) for r in range(size)]
    batches = []
    for gbs in step_sizes:
        parts = [s.next_batch(gbs) for s in streams]
        batches.append(torch.cat([p.inputs for p in parts]))
    return batches


def test_permutation_is_a_bijection():
    for n in (1, 2, 5, 64, 1000, 4097):
        image = permute(np.arange(n), n, (1, 2, 3))
        assert np.array_equal(np.sort(image), np.arange(n))
    assert not np.array_equal(
        permute(np.arange(100), 100, (1,)), permute(np.arange(100), 100, (2,))
    )


def test_same_global_batch_for_1_2_4_ranks(prepared):
    steps = [8, 8, 16, 4, 8]  # a batch-size ramp: the order counts sequences, not steps
    single = _global_batch(prepared, steps, 1)
    for size in (2, 4):
        for ours, ref in zip(_global_batch(prepared, steps, size), single, strict=True):
            assert torch.equal(ours, ref)


def test_rows_are_packed_slices_of_the_token_stream(prepared):
    stream = _stream(prepared, seq_len=32)
    store = TokenStore(prepared, "train")
    everything = store.read(0, store.num_tokens)
    batch = stream.batch_at(0, 64)
    rows = stream.global_rows(0, 64)
    for row, (_, offset) in enumerate(rows):
        assert offset % 32 == 0
        assert batch.inputs[row].tolist() == everything[offset : offset + 32].tolist()
        assert batch.targets[row].tolist() == everything[offset + 1 : offset + 33].tolist()
    one_epoch = [o for _, o in stream.global_rows(0, stream.num_sequences[0])]
    assert sorted(one_epoch) == [i * 32 for i in range(stream.num_sequences[0])]


def test_resume_mid_epoch_matches_uninterrupted_run_on_other_rank_counts(prepared):
    steps = [8] * 6 + [16] * 4
    reference = _global_batch(prepared, steps, 1)
    first = [_stream(prepared, rank=r, size=2) for r in range(2)]
    for gbs in steps[:5]:
        [s.next_batch(gbs) for s in first]
    state = first[1].state_dict()
    assert state == first[0].state_dict()  # world-size independent plain values
    assert all(isinstance(v, (int, str)) for v in state.values())
    resumed = [_stream(prepared, rank=r, size=4) for r in range(4)]
    for s in resumed:
        s.load_state_dict(dict(state))
    for gbs, ref in zip(steps[5:], reference[5:], strict=True):
        assert torch.equal(torch.cat([s.next_batch(gbs).inputs for s in resumed]), ref)


def test_mixture_proportions_and_epoch_accounting(prepared):
    weights = [0.5, 0.3, 0.2]
    stream = _stream(prepared, weights=weights, seq_len=16)
    sources = [s for s, _ in stream.global_rows(0, 3 * BLOCK + 1000)]
    share = np.bincount(sources, minlength=3) / len(sources)
    assert np.allclose(share, weights, atol=0.01)
    stream.consumed_sequences = 3 * BLOCK + 1000
    drawn = np.bincount(sources, minlength=3)
    expected = {n: d / stream.num_sequences[0] for n, d in zip(stream.names, drawn, strict=True)}
    assert stream.epochs() == pytest.approx(expected)
    assert apportion([1, 1, 1], 10).tolist() == [4, 3, 3]


def test_repetition_warning(prepared):
    stream = _stream(prepared, seq_len=64)
    stream.max_epochs_warning = 1.0
    n = stream.num_sequences[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream.batch_at(0, n)  # exactly one epoch: no warning
    with pytest.warns(RepetitionWarning, match="entered epoch 2"):
        stream.batch_at(n, 1)


def test_document_ids_and_positions(prepared):
    stream = _stream(prepared, seq_len=256, masking=True)
    store = TokenStore(prepared, "train")
    batch = stream.batch_at(0, 8)
    eos = 1
    for row in range(8):
        inputs = batch.inputs[row].tolist()
        ids, pos = batch.document_ids[row].tolist(), batch.positions[row].tolist()
        doc, p = 0, 0
        for i in range(len(inputs)):  # reference: a new document starts after each EOS
            if i > 0 and inputs[i - 1] == eos:
                doc, p = doc + 1, 0
            assert (ids[i], pos[i]) == (doc, p), (row, i)
            p += 1
    assert store.num_documents == len(store.doc_starts)


def test_iter_eval_is_fixed(prepared):
    stream = _stream(prepared)
    first = [b.inputs for b in stream.iter_eval(3, 4)]
    stream.next_batch(8)
    again = [b.inputs for b in stream.iter_eval(3, 4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_errors(prepared, tmp_path, corpus_docs):
    with pytest.raises(ValueError, match="multiple of dp_size"):
        _stream(prepared, rank=0, size=2).next_batch(3)
    with pytest.raises(ValueError, match="seq_len 100000 is longer than dataset"):
        _stream(prepared, seq_len=100_000)
    with pytest.raises(ValueError, match=r"data.weights\[1\] must be"):
        DataConfig(datasets=["a", "b"], weights=[1.0, -1.0]).validate()
    with pytest.raises(ValueError, match="sum to a positive"):
        DataConfig(datasets=["a", "b"], weights=[0.0, 0.0]).validate()
    with pytest.raises(ValueError, match="one weight per dataset"):
        DataConfig(datasets=["a", "b"], weights=[1.0]).validate()
    with pytest.raises(ValueError, match="seed"):
        _stream(prepared).load_state_dict(_stream(prepared, seed=4).state_dict())
    with pytest.raises(FileNotFoundError, match="not a complete prepared dataset"):
        build_data(DataConfig(datasets=[str(tmp_path)]))


def test_build_data_and_tokenizer_mismatch(prepared, tmp_path, corpus_docs):
    from densetrain.data import train_tokenizer

    bundle = build_data(DataConfig(datasets=[str(prepared)], seq_len=32), dp_rank=1, dp_size=2)
    assert bundle.train.next_batch(4).inputs.shape == (2, 32)
    assert bundle.val is not None and bundle.val.next_batch(2).targets.shape == (1, 32)
    assert bundle.tokenizer.fingerprint == bundle.train.stores[0].meta["tokenizer"]["fingerprint"]
    other = train_tokenizer(corpus_docs[:40], tmp_path / "other.json", vocab_size=300)
    with pytest.raises(ValueError, match="differs from the tokenizer the datasets were prepared"):
        build_data(DataConfig(datasets=[str(prepared)], tokenizer=other.path))
