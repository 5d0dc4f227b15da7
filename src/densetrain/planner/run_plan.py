"""From a FLOP budget to a run plan: compute-optimal N and D, a model shape, a layout, days.

N_opt and D_opt come in as an `Allocation`, which ``densetrain.scaling.optimal.allocation``
computes (Chinchilla's approach-3 closed form; the caller passes it because the planner sits
below ``scaling``, which imports it).
The shape keeps everything but the sizes from a base preset (LLaMA 3 by default) and picks
width and depth near the aspect ratio dim / num_layers = 128 of LLaMA 3 8B/405B (Kaplan et al.
2020, sec. 3.1, find loss flat over a wide range of it), with 128-wide heads and a SwiGLU hidden
width of 8/3 dim rounded to a multiple of 256; among shapes within 5% of N_opt the one nearest
that ratio wins. Parameter counts come from ``models.sizing.param_counts``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.planner.compute import sizing_module
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import PlanSettings
from densetrain.planner.search import PlanResult, SearchSpace, search

HEAD_DIM = 128
TARGET_ASPECT = 128.0


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """A FLOP budget split into parameters and tokens, and the law (with its constants) that
    split it; with ``inference_tokens`` the budget is training plus inference."""

    flops: float
    num_params: float
    num_tokens: float
    law: str
    inference_tokens: float = 0.0


@dataclass(kw_only=True)
class RunPlan:
    """A compute-optimal run: model, tokens, the best layout and its predicted duration."""

    flops: float
    target_params: float
    num_tokens: float
    cfg: ModelConfig
    num_params: int
    layout_plan: PlanResult
    law: str
    inference_tokens: float = 0.0

    @property
    def training_days(self) -> float:
        """Wall-clock days to train on ``num_tokens`` at the winner's predicted tokens/s."""
        return self.num_tokens / self.layout_plan.row(0)["tokens_per_s"] / 86400.0


def _shape(base: ModelConfig, dim: int, num_layers: int) -> ModelConfig:
    ffn = int(math.ceil(8 * dim / 3 / 256) * 256)
    heads = dim // HEAD_DIM
    kv_heads = math.gcd(heads, base.num_kv_heads)
    return base.replace(dim=dim, embed_dim=dim, num_layers=num_layers, num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=HEAD_DIM, ffn_dim=ffn)


def shape_for_params(num_params: float, base: ModelConfig) -> ModelConfig:
    """A config of about ``num_params`` total parameters, sized as the module docstring says.

    Ties go to head counts that are multiples of 8 (so tp up to 8 divides them).
    """
    if not num_params > 0:
        raise UserError(f"num_params must be > 0, got {num_params}")
    count = sizing_module().param_counts
    best: tuple | None = None
    embed = 2 * base.padded_vocab_size
    for num_layers in range(1, 257):
        # The block is about 12 dim^2 parameters (4 for attention, 8 for a 8/3-wide SwiGLU).
        dim_est = (-embed + math.sqrt(embed**2 + 48 * num_layers * num_params)) / (24 * num_layers)
        centre = int(dim_est // HEAD_DIM)
        for heads in range(max(1, centre - 8), centre + 12):
            cfg = _shape(base, heads * HEAD_DIM, num_layers)
            error = abs(count(cfg).total / num_params - 1)
            aspect = abs(math.log(cfg.dim / num_layers / TARGET_ASPECT))
            key = (error > 0.05 and error, heads % 8 != 0, aspect)
            if best is None or key < best[0]:
                best = (key, cfg)
    return best[1]


def plan_run(allocation: Allocation, *, base: ModelConfig, seq_len: int, global_batch: int,
             devices: int, cluster: ClusterSpec, settings: PlanSettings | None = None,
             space: SearchSpace | None = None) -> RunPlan:
    """Chain a compute-optimal N and D (``scaling.optimal.allocation``) to the layout search
    (``NoFeasibleLayoutError`` if none)."""
    cfg = shape_for_params(allocation.num_params, base).replace(
        max_seq_len=max(seq_len, base.max_seq_len))
    result = search(cfg, seq_len=seq_len, global_batch=global_batch, devices=devices,
                    cluster=cluster, settings=settings, space=space or SearchSpace())
    return RunPlan(flops=allocation.flops, target_params=allocation.num_params,
                   num_tokens=allocation.num_tokens, cfg=cfg,
                   num_params=sizing_module().param_counts(cfg).total, layout_plan=result,
                   law=allocation.law, inference_tokens=allocation.inference_tokens)


def format_run_plan(plan: RunPlan) -> str:
    """The run plan as printable text."""
    cfg, row = plan.cfg, plan.layout_plan.row(0)
    layout = plan.layout_plan.layout(0)
    steps = plan.num_tokens / (plan.layout_plan.global_batch * plan.layout_plan.seq_len)
    lines = [
        f"Law: {plan.law}",
        f"Budget {plan.flops:.3e} FLOPs -> N_opt {plan.target_params:.3e} params, "
        f"D_opt {plan.num_tokens:.3e} tokens",
        f"Model: dim {cfg.dim}, {cfg.num_layers} layers, {cfg.num_heads} heads "
        f"({cfg.num_kv_heads} kv), ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}: "
        f"{plan.num_params:,} parameters",
        f"Tokens: {plan.num_tokens:,.0f} in steps of {plan.layout_plan.global_batch} x "
        f"{plan.layout_plan.seq_len} = {steps:,.0f} steps",
        f"Layout: {layout.describe()} on {plan.layout_plan.devices} x "
        f"{plan.layout_plan.cluster.name}",
        f"Predicted: {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%}, "
        f"{plan.training_days:.1f} days",
    ]
    if plan.inference_tokens > 0:
        lines.append(_lifetime_line(plan))
    return "\n".join(lines)


def _lifetime_line(plan: RunPlan) -> str:
    """Training and inference FLOPs of the shaped model by PaLM's count (inference is the
    forward third of it), against the budget."""
    per_token = sizing_module().flops_per_token_palm(plan.cfg, plan.layout_plan.seq_len)
    train, infer = per_token * plan.num_tokens, per_token / 3 * plan.inference_tokens
    return (f"Lifetime ({plan.inference_tokens:.3e} inference tokens): training "
            f"{train:.3e} + inference {infer:.3e} = {train + infer:.3e} FLOPs of this shape "
            f"(PaLM 6N + 12LHQT count; budget {plan.flops:.3e} by 6ND + 2NT)")
