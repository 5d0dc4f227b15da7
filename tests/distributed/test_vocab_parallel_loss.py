"""Vocab-parallel cross-entropy equals the one-process ``cross_entropy_loss`` (value and
gradients), with vocab padding, ignored targets and z-loss, on uneven vocab shards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from densetrain.models.loss import cross_entropy_loss
from densetrain.parallel.loss import vocab_parallel_cross_entropy
from densetrain.testing import run_distributed

VOCAB, PADDED, TOKENS, Z = 101, 104, 24, 1e-3
SPLIT = (55, 49)  # uneven shards of the padded rows (the second holds the padding)


def _compare(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(7)
    logits_NP = torch.randn(TOKENS, PADDED, generator=g) * 3
    targets_N = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets_N[::5] = -100
    ref_logits = logits_NP[:, :VOCAB].clone().requires_grad_()
    ref = cross_entropy_loss(ref_logits, targets_N, z_loss_coef=Z)
    ref.loss.backward()
    offset = sum(SPLIT[:rank])
    local = logits_NP[:, offset : offset + SPLIT[rank]].clone().requires_grad_()
    out = vocab_parallel_cross_entropy(
        local, targets_N, vocab_offset=offset, vocab_size=VOCAB, group=dist.group.WORLD,
        z_loss_coef=Z,
    )
    out.loss.backward()
    ref_grad = torch.zeros(TOKENS, PADDED)
    ref_grad[:, :VOCAB] = ref_logits.grad
    return {
        "loss": (out.loss.item(), ref.loss.item()),
        "z": (out.z_loss.item(), ref.z_loss.item()),
        "tokens": (out.num_tokens.item(), ref.num_tokens.item()),
        "grad_err": (local.grad - ref_grad[:, offset : offset + SPLIT[rank]]).abs().max().item(),
    }


def test_vocab_parallel_cross_entropy_matches_full_softmax():
    for result in run_distributed(_compare, 2):
        # fp32: one reordering of the exp-sum across two shards, ~1e-7 relative
        assert abs(result["loss"][0] - result["loss"][1]) < 1e-5, result
        assert abs(result["z"][0] - result["z"][1]) < 1e-6, result
        assert result["tokens"][0] == result["tokens"][1]
        assert result["grad_err"] < 1e-6, result


# The fused, chunked head (`vocab_parallel_chunked_loss`): hidden states and this rank's rows of
# a padded [P, E] head, split as the model's Shard(0) DTensor splits it.
WIDTH, CHUNK_TOKENS = 16, 29
CHUNKED_CASES = {
    # vocab_size, padded rows (the model's vocab_pad_multiple rounding), chunk size, z-loss
    "pad_on_last_rank": (101, 104, 10, Z),  # 29 tokens: chunks of 10, 10, 9
    "uneven_shards": (101, 105, 7, 0.0),  # 53 / 52 rows, padding on the last rank
    "padding_only_rank": (50, 120, 4, Z),  # rank 1 (rows 60-119) holds no vocab row at all
    "one_chunk": (101, 104, 1000, Z),  # chunk larger than the micro-batch
}


def _shard(rows: int, rank: int, world: int) -> tuple[int, int]:
    from torch.distributed.tensor import Shard

    return Shard(0).local_shard_size_and_offset(rows, world, rank)


def _chunked_compare(rank: int, world: int, case: str, seed_scale: float,
                     bias: bool) -> dict:
    import torch.nn.functional as F

    from densetrain.parallel.loss import vocab_parallel_chunked_loss

    vocab, padded, chunk, z = CHUNKED_CASES[case]
    g = torch.Generator().manual_seed(11)
    hidden_NE = torch.randn(CHUNK_TOKENS, WIDTH, generator=g)
    weight_PE = torch.randn(padded, WIDTH, generator=g)
    bias_P = torch.randn(padded, generator=g) if bias else None
    targets_N = torch.randint(0, vocab, (CHUNK_TOKENS,), generator=g)
    targets_N[::4] = -100
    rows, offset = _shard(padded, rank, world)

    # one process: the full logits' cross_entropy_loss
    ref_h = hidden_NE.clone().requires_grad_()
    ref_w = weight_PE.clone().requires_grad_()
    ref_b = bias_P.clone().requires_grad_() if bias else None
    ref = cross_entropy_loss(F.linear(ref_h, ref_w, ref_b)[:, :vocab], targets_N, z_loss_coef=z)
    (ref.loss * seed_scale).backward()

    def local_leaves():
        h = hidden_NE.clone().requires_grad_()
        w = weight_PE[offset : offset + rows].clone().requires_grad_()
        b = bias_P[offset : offset + rows].clone().requires_grad_() if bias else None
        return h, w, b

    kwargs = dict(vocab_offset=offset, vocab_size=vocab, group=dist.group.WORLD, z_loss_coef=z)
    # the unchunked vocab-parallel loss (today's path without loss_chunk_size)
    un_h, un_w, un_b = local_leaves()
    unchunked = vocab_parallel_cross_entropy(F.linear(un_h, un_w, un_b), targets_N, **kwargs)
    (unchunked.loss * seed_scale).backward()
    # the chunked one
    ch_h, ch_w, ch_b = local_leaves()
    chunked = vocab_parallel_chunked_loss(ch_h, ch_w, targets_N, chunk_size=chunk, bias_L=ch_b,
                                          **kwargs)
    (chunked.loss * seed_scale).backward()
    with torch.no_grad():
        no_grad = vocab_parallel_chunked_loss(hidden_NE, weight_PE[offset : offset + rows],
                                              targets_N, chunk_size=chunk,
                                              bias_L=None if not bias else
                                              bias_P[offset : offset + rows], **kwargs)

    # the hidden gradient of each rank is a partial sum over its vocab rows (DTensor's Partial)
    for h in (un_h, ch_h):
        dist.all_reduce(h.grad)

    def err(a, b):
        return (a - b).abs().max().item()

    result = {
        "loss": (chunked.loss.item(), unchunked.loss.item(), ref.loss.item(),
                 no_grad.loss.item()),
        "ce": (chunked.ce_loss.item(), ref.ce_loss.item()),
        "z": (chunked.z_loss.item(), ref.z_loss.item()),
        "tokens": (chunked.num_tokens.item(), ref.num_tokens.item()),
        "hidden_err": err(ch_h.grad, ref_h.grad),
        "hidden_err_unchunked": err(ch_h.grad, un_h.grad),
        "weight_err": err(ch_w.grad, ref_w.grad[offset : offset + rows]),
        "weight_err_unchunked": err(ch_w.grad, un_w.grad),
        "padding_grad": ch_w.grad[max(vocab - offset, 0):].abs().max().item()
        if vocab - offset < rows else 0.0,
        "grad_scale": ref_h.grad.abs().max().item(),
    }
    if bias:
        result["bias_err"] = err(ch_b.grad, ref_b.grad[offset : offset + rows])
        result["bias_err_unchunked"] = err(ch_b.grad, un_b.grad)
    return result


def _check(result: dict) -> None:
    loss, unchunked, ref, no_grad = result["loss"]
    for other in (unchunked, ref, no_grad):
        assert abs(loss - other) < 1e-5 * max(1.0, abs(ref)), result
    assert abs(result["ce"][0] - result["ce"][1]) < 1e-5 * max(1.0, abs(ref)), result
    assert abs(result["z"][0] - result["z"][1]) < 1e-6 * max(1.0, result["z"][1]), result
    assert result["tokens"][0] == result["tokens"][1], result
    for key, value in result.items():
        if key.endswith("_err") or key.endswith("_unchunked"):
            assert value < 1e-5, (key, result)  # fp32; gradients here are O(1e-2)
    assert result["padding_grad"] == 0.0, result


@pytest.mark.parametrize("case", sorted(CHUNKED_CASES))
def test_chunked_vocab_parallel_loss_matches_unchunked_and_full_softmax(case):
    for result in run_distributed(_chunked_compare, 2, case, 1.0, True):
        _check(result)


def test_chunked_vocab_parallel_loss_scales_by_seed_without_bias():
    # a seed other than 1 (gradient accumulation's 1/k): backward scales the saved gradients
    for result in run_distributed(_chunked_compare, 2, "pad_on_last_rank", 0.25, False):
        _check(result)


def _chunked_autocast(rank: int, world: int) -> dict:
    """bf16 autocast: the matmuls in bf16, the softmax in fp32; compared with the unchunked
    loss under the same autocast."""
    import torch.nn.functional as F

    from densetrain.parallel.loss import vocab_parallel_chunked_loss

    vocab, padded = 101, 104
    g = torch.Generator().manual_seed(3)
    hidden_NE = torch.randn(CHUNK_TOKENS, WIDTH, generator=g)
    weight_PE = torch.randn(padded, WIDTH, generator=g) * 0.3
    targets_N = torch.randint(0, vocab, (CHUNK_TOKENS,), generator=g)
    rows, offset = _shard(padded, rank, world)
    kwargs = dict(vocab_offset=offset, vocab_size=vocab, group=dist.group.WORLD, z_loss_coef=Z)
    out = {}
    for name in ("unchunked", "chunked"):
        h = hidden_NE.clone().requires_grad_()
        w = weight_PE[offset : offset + rows].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "chunked":
                loss = vocab_parallel_chunked_loss(h, w, targets_N, chunk_size=8, **kwargs)
            else:
                loss = vocab_parallel_cross_entropy(F.linear(h, w), targets_N, **kwargs)
        loss.loss.backward()
        dist.all_reduce(h.grad)
        out[name] = (loss.loss.item(), h.grad, w.grad)
    (l0, h0, w0), (l1, h1, w1) = out["unchunked"], out["chunked"]
    return {"loss": (l0, l1), "dtypes": (h1.dtype, w1.dtype),
            "hidden_rel": ((h1 - h0).norm() / h0.norm()).item(),
            "weight_rel": ((w1 - w0).norm() / w0.norm()).item()}


def test_chunked_vocab_parallel_loss_under_bf16_autocast():
    for result in run_distributed(_chunked_autocast, 2):
        assert abs(result["loss"][0] - result["loss"][1]) < 1e-3 * abs(result["loss"][1]), result
        assert result["dtypes"] == (torch.float32, torch.float32), result
        # bf16 products (the unchunked loss rounds its logits' gradient to bf16 as well)
        assert result["hidden_rel"] < 2e-2 and result["weight_rel"] < 2e-2, result
