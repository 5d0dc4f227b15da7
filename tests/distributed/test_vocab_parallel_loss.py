"""Vocab-parallel cross-entropy equals the one-process ``cross_entropy_loss`` (value and
gradients), with vocab padding, ignored targets and z-loss, on uneven vocab shards."""

from __future__ import annotations

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
