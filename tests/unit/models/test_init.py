"""The counter-based initial values (`models.init`): the generator against its definition in
Python integers, any part of a tensor against the whole, and the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from densetrain.models import init as init_module
from densetrain.models.init import normal_at, seeded_normal, splitmix64, stream_key

MASK = (1 << 64) - 1


def splitmix64_reference(key: int, counter: int) -> int:
    """SplitMix64 (Steele et al. 2014) in unbounded Python integers: state key + (i+1)·γ."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_splitmix64_equals_the_unsigned_definition():
    counters = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**40 + 7, 2**62 - 3]
    for key in (0, 1, stream_key(0, "tok_embeddings.weight"), MASK):
        got = splitmix64(key, torch.tensor(counters, dtype=torch.long))
        for counter, value in zip(counters, got.tolist(), strict=True):
            assert value & MASK == splitmix64_reference(key, counter), (key, counter)


def test_normal_values_follow_box_muller_of_the_two_halves():
    key = stream_key(3, "layers.0.attn.wq.weight")
    counters = torch.arange(50)
    got = normal_at(key, counters, 0.02)
    for counter in range(50):
        bits = splitmix64_reference(key, counter)
        u1 = ((bits >> 32) + 0.5) / 2**32
        u2 = (bits & 0xFFFFFFFF) / 2**32
        expected = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2) * 0.02
        assert got[counter].item() == pytest.approx(expected, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("block", [7, 64, 1 << 20])
def test_any_part_equals_that_part_of_the_whole(block, monkeypatch):
    """Rows, columns, strided and permuted positions: the same bits as the full draw, whatever
    the block size the draw is cut into."""
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", block)
    full = seeded_normal((37, 23), 0.5, 9, "w")
    assert full.shape == (37, 23) and full.dtype == torch.float32
    rows = torch.tensor([0, 5, 6, 36])
    cols = torch.arange(3, 23, 4)
    assert torch.equal(seeded_normal((37, 23), 0.5, 9, "w", [rows, None]), full[rows])
    assert torch.equal(seeded_normal((37, 23), 0.5, 9, "w", [None, cols]), full[:, cols])
    assert torch.equal(seeded_normal((37, 23), 0.5, 9, "w", [rows, cols]), full[rows][:, cols])
    vector = seeded_normal((101,), 1.0, 9, "b")
    assert torch.equal(seeded_normal((101,), 1.0, 9, "b", [torch.arange(50, 101)]), vector[50:])
    cube = seeded_normal((4, 5, 6), 1.0, 2, "c")
    part = seeded_normal((4, 5, 6), 1.0, 2, "c", [torch.tensor([3]), None, torch.tensor([1, 4])])
    assert torch.equal(part, cube[3:4][:, :, [1, 4]])


def test_streams_differ_by_seed_and_name():
    base = seeded_normal((64, 64), 1.0, 0, "a")
    assert not torch.equal(base, seeded_normal((64, 64), 1.0, 1, "a"))
    assert not torch.equal(base, seeded_normal((64, 64), 1.0, 0, "b"))
    assert torch.equal(base, seeded_normal((64, 64), 1.0, 0, "a"))


def test_values_are_normal_with_the_asked_std():
    """Kolmogorov-Smirnov against N(0, std) (SciPy) and the moments on a million values."""
    scipy_stats = pytest.importorskip("scipy.stats")
    values = seeded_normal((1000, 1000), 0.02, 0, "layers.3.mlp.w_up.weight").double()
    assert abs(values.mean().item()) < 5 * 0.02 / 1000
    assert values.std().item() == pytest.approx(0.02, rel=3e-3)
    assert scipy_stats.kstest(values.flatten().numpy(), "norm", args=(0, 0.02)).pvalue > 1e-3
    neighbours = torch.corrcoef(torch.stack([values.flatten()[:-1], values.flatten()[1:]]))
    assert abs(neighbours[0, 1].item()) < 5e-3
