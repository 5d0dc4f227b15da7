"""FLOP counts of Transformer-XL relative positions (``relative_xl``) against torch's own counter.

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls that a real forward + backward
of a tiny ``Transformer`` dispatches (mm, addmm, bmm, ...), and nothing else: no norms, no
element-wise work. SDPA runs on its math backend (``sdpa_kernel(SDPBackend.MATH)``) so that
QK^T and AV are bmm calls the counter sees: its CPU flash kernel has no FLOP formula, and
relative attention's float mask, which needs a gradient, takes the math path on CPU anyway.

The tolerance is zero. Both sides count the same matmuls with the formulas' conventions (full
S x T score matrices, as the math backend computes them; every input gradient, the embeddings
needing one), and the one known difference is subtracted explicitly: PaLM's N holds the norm
weights, 6 FLOPs per token each, which are no matmul. All counts are integers far below 2^53,
so the float comparisons are exact.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from densetrain.models import ModelConfig, Transformer
from densetrain.models.sizing import (
    attention_flops_per_token,
    chinchilla_flops_breakdown,
    flops_per_token_executed,
    flops_per_token_palm,
    matmul_params,
    param_counts,
    relative_position_params,
    relative_projection_flops,
)

SEQ = 32


def _tiny(position: str, **overrides) -> ModelConfig:
    fields = dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, ffn_dim=96, max_seq_len=SEQ,
                  position_embedding=position, activation="swiglu", norm_type="rmsnorm")
    fields.update(overrides)
    return ModelConfig(**fields)


def _counted_flops(cfg: ModelConfig, batch: int) -> int:
    """Matmul FLOPs torch counts for one forward + backward over a [batch, SEQ] microbatch."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ),
                           generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).square().mean().backward()
    return counter.get_total_flops()


def _norm_params(cfg: ModelConfig) -> int:
    """RMSNorm weights (two per layer and the final norm): in N, but no matmul."""
    return (2 * cfg.num_layers + 1) * cfg.dim


@pytest.mark.parametrize("batch", [1, 3])
def test_rope_control_counts_palm_exactly(batch):
    cfg = _tiny("rope", num_kv_heads=2)
    tokens = batch * SEQ
    expected = (flops_per_token_palm(cfg, SEQ) - 6 * _norm_params(cfg)) * tokens
    assert _counted_flops(cfg, batch) == expected


@pytest.mark.parametrize("batch", [1, 3])
def test_relative_xl_counts_position_scores_and_projection_exactly(batch):
    cfg = _tiny("relative_xl")
    tokens = batch * SEQ
    executed = flops_per_token_executed(cfg, SEQ, batch)
    counted = _counted_flops(cfg, batch)
    assert counted == (executed - 6 * _norm_params(cfg)) * tokens
    # Against the same model with RoPE, relative attention adds a third attention matmul per
    # token (6·L·q·T fwd + bwd) and W_R's projection with its weight gradient once per
    # microbatch (2·2·L·T·d·q), nothing per token for W_R.
    extra = counted - _counted_flops(_tiny("rope"), batch)
    layers, q, d = cfg.num_layers, cfg.q_dim, cfg.dim
    assert extra == 6 * layers * q * SEQ * tokens + 4 * layers * SEQ * d * q


def test_palm_count_leaves_the_projection_out_and_the_executed_count_adds_it():
    cfg = _tiny("relative_xl")
    position = cfg.num_layers * relative_position_params(cfg)
    assert position == cfg.num_layers * (cfg.dim * cfg.q_dim + 2 * cfg.q_dim)
    assert matmul_params(cfg) == (param_counts(cfg).non_embedding - position
                                  + cfg.vocab_size * cfg.dim)
    assert attention_flops_per_token(cfg, SEQ) == 18 * cfg.num_layers * cfg.q_dim * SEQ
    assert flops_per_token_palm(cfg, SEQ) == 6 * matmul_params(cfg) + 18 * 2 * 64 * SEQ
    # The projection is paid per microbatch: its share per token falls with the batch.
    projection = relative_projection_flops(cfg, SEQ)
    assert projection == 2 * cfg.num_layers * SEQ * cfg.dim * cfg.q_dim
    for batch in (1, 4):
        assert flops_per_token_executed(cfg, SEQ, batch) == pytest.approx(
            flops_per_token_palm(cfg, SEQ) + 2 * projection / (batch * SEQ), rel=1e-15)
    rope = _tiny("rope")
    assert flops_per_token_executed(rope, SEQ, 4) == flops_per_token_palm(rope, SEQ)
    with pytest.raises(ValueError, match="micro_batch"):
        flops_per_token_executed(cfg, SEQ, 0)


def test_chinchilla_appendix_f_has_no_position_term():
    """Appendix F (Hoffmann et al. 2022) lists no relative-position FLOPs; the count stays the
    paper's, so switching the position encoding does not change it."""
    relative, rope = _tiny("relative_xl"), _tiny("rope")
    assert chinchilla_flops_breakdown(relative, SEQ) == chinchilla_flops_breakdown(rope, SEQ)
