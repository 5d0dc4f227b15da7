"""The planner's memory, FLOPs and time for Transformer-XL relative positions (``relative_xl``)
against the real model: the bytes autograd saves and the matmul FLOPs torch counts.

Memory is measured in fp32, where CPU runs relative attention as it runs on any device without
a fused kernel (``flash_attention=False``): SDPA with a float mask that needs a gradient takes
the math path on CPU (its flash kernel takes no such mask). In bf16 that path computes in fp32
(q, k, v and the softmax saved as fp32 copies, about 30% more than a bf16 model predicts), so
bf16 would measure the CPU kernel's upcast rather than the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_planner_memory import saved_bytes_per_layer
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from densetrain.models import ModelConfig, Transformer
from densetrain.models.sizing import attention_flops_per_token, relative_projection_flops
from densetrain.parallel.checkpointing import apply_activation_checkpointing
from densetrain.planner.compute import hardware_flops_per_token, recompute_flops_per_token
from densetrain.planner.hardware import get_cluster
from densetrain.planner.layout import AC_POLICIES, Layout, PlanSettings
from densetrain.planner.memory import layer_activation_bytes
from densetrain.planner.search import evaluate_layout

NONE, FULL = AC_POLICIES.index("none"), AC_POLICIES.index("full")
BASE = dict(vocab_size=512, dim=256, num_heads=4, ffn_dim=512, activation="swiglu",
            norm_type="layernorm", max_seq_len=256)


def _saved_bytes_per_layer(fields: dict, seq: int, batch: int) -> float:
    """Bytes autograd saves per decoder layer in an fp32 forward of the real ``Transformer``."""
    return saved_bytes_per_layer(fields, seq, batch, dtype="float32")


def _predicted(cfg: ModelConfig, seq: int, batch: int, flash: bool = False) -> float:
    return float(layer_activation_bytes(cfg, seq_len=seq, micro_batch=batch, tp=1,
                                        sequence_parallel=False, policy=NONE,
                                        flash_attention=flash, dropout=False, activation_bytes=4))


@pytest.mark.parametrize("batch", [1, 2])
def test_relative_activation_bytes_match_what_autograd_saves(batch):
    """Within 0.2%: the model leaves out LayerNorm's fp32 mean and rstd (2 x 2 x 4 bytes per
    token and layer, 0.07% here); every other saved tensor is counted, the s x T softmax, the
    position matmul's inputs (q + v, the batch-expanded position keys), W_R's sinusoids and
    the boolean causal mask among them."""
    fields = dict(BASE, position_embedding="relative_xl")
    seq = 256
    cfg = ModelConfig(num_layers=2, **fields)
    measured = _saved_bytes_per_layer(fields, seq, batch)
    assert measured == pytest.approx(_predicted(cfg, seq, batch), rel=2e-3)
    # What relative attention adds is large enough for the check to see: the same layer with
    # RoPE's formula (no position terms) is more than 10% short.
    rope = ModelConfig(num_layers=2, **dict(BASE, position_embedding="rope"))
    assert measured > 1.1 * _predicted(rope, seq, batch)


def test_fused_kernel_keeps_the_position_bias_instead_of_the_softmax():
    """With a fused kernel (CUDA's memory-efficient SDPA) the s x T bias is stored in place of
    the s x T softmax of the math path: the same size, so the layer differs only by the
    log-sum-exp (4 bytes per query and head) the fused kernel adds."""
    cfg = ModelConfig(num_layers=2, **dict(BASE, position_embedding="relative_xl"))
    seq, batch = 256, 2
    lse = cfg.num_heads * seq * batch * 4
    assert _predicted(cfg, seq, batch, flash=True) == _predicted(cfg, seq, batch) + lse
    rope = ModelConfig(num_layers=2, **dict(BASE, position_embedding="rope"))
    scores = cfg.num_heads * seq * seq * batch * 4
    assert _predicted(rope, seq, batch, flash=True) < _predicted(cfg, seq, batch, True) - scores


def _counted_with_full_recompute(cfg: ModelConfig, seq: int, batch: int) -> int:
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    apply_activation_checkpointing(model, "full")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).square().mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("batch", [1, 2])
def test_hardware_flops_with_full_recompute_match_torch_counter(batch):
    """Exact, with one known difference subtracted: the planner's N holds the RMSNorm weights
    (6 FLOPs per token each, 2 more in the recomputed forward), which are no matmul. Torch's
    non-reentrant checkpoint stops recomputing once the last tensor backward needs is rebuilt,
    so a pre-norm block without dropout never re-runs its final matmul, w_down (2·d·ffn per
    token and layer): the planner's ``early_stop`` count leaves it out, the whole-block count
    (Korthikanti et al. 2022's) keeps it."""
    seq = 32
    cfg = ModelConfig(num_layers=2, **dict(BASE, position_embedding="relative_xl",
                                            norm_type="rmsnorm", max_seq_len=seq))
    norms = (2 * cfg.num_layers + 1) * cfg.dim
    not_matmul = 6 * norms + 2 * norms
    early_stop = 2 * cfg.num_layers * cfg.dim * cfg.ffn_dim
    predicted = float(hardware_flops_per_token(cfg, seq, FULL, False, batch, early_stop=True))
    whole_block = float(hardware_flops_per_token(cfg, seq, FULL, False, batch))
    counted = _counted_with_full_recompute(cfg, seq, batch)
    assert counted == (predicted - not_matmul) * batch * seq
    assert whole_block - predicted == early_stop
    # Without the micro-batch, recompute leaves W_R's per-microbatch forward out.
    short = recompute_flops_per_token(cfg, seq, FULL, False)
    exact = recompute_flops_per_token(cfg, seq, FULL, False, micro_batch=batch)
    assert float(exact - short) == relative_projection_flops(cfg, seq) / (batch * seq)


def test_attention_time_covers_the_extra_work_at_peak():
    """On an H100 the relative layer's attention time exceeds the RoPE layer's by at least the
    extra attention FLOPs at peak: the position-score matmul (6·L·H·Q·T per token) plus the
    causal half a fused kernel with a float mask cannot skip (6·L·H·Q·T), and W_R."""
    cluster = get_cluster("h100-80gb")
    seq, batch = 4096, 8
    fields = dict(vocab_size=32000, dim=2048, num_layers=4, num_heads=16, ffn_dim=8192,
                  activation="gelu", max_seq_len=seq)
    layout = Layout(micro_batch_size=1, dp_shard=8, zero_stage=3)
    times = {}
    for position in ("rope", "relative_xl"):
        cfg = ModelConfig(position_embedding=position, **fields)
        row = evaluate_layout(cfg, seq, batch, layout, cluster, PlanSettings())
        times[position] = row["attention_s"]
    relative = ModelConfig(position_embedding="relative_xl", **fields)
    tokens = seq  # one microbatch of one sequence per device
    extra_flops = (attention_flops_per_token(relative, seq) * tokens * 2 / 3
                   + 2 * relative_projection_flops(relative, seq))
    assert times["relative_xl"] - times["rope"] > extra_flops / cluster.peak_flops
    assert np.isfinite(times["relative_xl"])
