"""Layout search: enumerate every layout a model, batch and device count allow, evaluate them
all at once (numpy columns), keep those that fit in memory and rank them by tokens/s.

When nothing can serve the request, ``NoFeasibleLayoutError`` says which constraint binds
(divisibility of devices or batch, or memory and by which component) instead of returning an
empty table.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.planner.comm import comm_columns
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import (
    AC_POLICIES,
    PP_SCHEDULES,
    Layout,
    LayoutColumns,
    PlanSettings,
)
from densetrain.planner.memory import memory_columns
from densetrain.planner.params import check_tensor_parallel
from densetrain.planner.timing import time_columns

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which values each layout axis may take."""

    max_tp: int = 64
    max_cp: int = 16
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    virtual_stages: tuple[int, ...] = (2, 4)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    activation_checkpointing: tuple[str, ...] = AC_POLICIES
    schedules: tuple[str, ...] = PP_SCHEDULES


class NoFeasibleLayoutError(ValueError):
    """No layout can serve the request; the message names the binding constraint."""


@dataclass(kw_only=True)
class PlanResult:
    """Fitting layouts ranked by predicted tokens/s (row 0 is the winner)."""

    cfg: ModelConfig
    seq_len: int
    global_batch: int
    devices: int
    cluster: ClusterSpec
    settings: PlanSettings
    layouts: LayoutColumns
    metrics: dict[str, np.ndarray]
    num_candidates: int
    elapsed_s: float

    def __len__(self) -> int:
        return len(self.layouts)

    def layout(self, i: int = 0) -> Layout:
        """The i-th ranked layout."""
        return self.layouts.row(i)

    def row(self, i: int = 0) -> dict[str, float]:
        """All metrics of the i-th ranked layout as floats."""
        return {k: float(v[i]) for k, v in self.metrics.items()}


def evaluate(cfg: ModelConfig, seq_len: int, global_batch: int, cols: LayoutColumns,
             cluster: ClusterSpec, settings: PlanSettings) -> dict[str, np.ndarray]:
    """Memory (bytes), communication (bytes, s) and time metrics for every row of ``cols``."""
    mem = memory_columns(cfg, seq_len, global_batch, cols, settings)
    comm = comm_columns(cfg, seq_len, cols, settings, cluster, mem)
    timing = time_columns(cfg, seq_len, global_batch, cols, settings, cluster, mem, comm)
    usable = cluster.memory_bytes * settings.usable_memory_fraction
    return {**{f"mem_{k}": v for k, v in mem.items()}, **comm, **timing,
            "fits": mem["total"] <= usable}


def evaluate_layout(cfg: ModelConfig, seq_len: int, global_batch: int, layout: Layout,
                    cluster: ClusterSpec, settings: PlanSettings | None = None) -> dict[str, float]:
    """Every metric of one layout (``ValueError`` if the layout cannot run this model/batch)."""
    problem = check_tensor_parallel(cfg, layout.tp)
    if problem:
        raise ValueError(f"layout: {problem}")
    layout.num_microbatches(global_batch)
    if seq_len % layout.cp:
        raise ValueError(f"layout.cp={layout.cp} must divide seq_len={seq_len}")
    cols = LayoutColumns.from_layouts([layout])
    out = evaluate(cfg, seq_len, global_batch, cols, cluster, settings or PlanSettings())
    return {k: float(v[0]) for k, v in out.items()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _schedules(cfg: ModelConfig, pp: int, m: int, space: SearchSpace) -> list[tuple[int, int]]:
    if pp == 1:
        return [(PP_SCHEDULES.index("1f1b"), 1)]
    out = []
    for name in space.schedules:
        if name == "interleaved_1f1b":
            out += [(PP_SCHEDULES.index(name), v) for v in space.virtual_stages
                    if cfg.num_layers % (pp * v) == 0 and m % pp == 0]
        elif m >= pp:
            out.append((PP_SCHEDULES.index(name), 1))
    return out


def enumerate_layouts(cfg: ModelConfig, seq_len: int, global_batch: int, devices: int,
                      settings: PlanSettings, space: SearchSpace):
    """All layouts for the request as ``LayoutColumns``, plus counts of why others were dropped."""
    dropped = {"tp": 0, "batch": 0, "pipeline": 0}
    outer = []  # (tp, pp, cp, dp, mbs, schedule, v)
    tps = [t for t in _powers_of_two(min(space.max_tp, devices))
           if check_tensor_parallel(cfg, t) is None]
    dropped["tp"] = len(_powers_of_two(min(space.max_tp, devices))) - len(tps)
    cps = [c for c in _powers_of_two(min(space.max_cp, devices))
           if c == 1 or seq_len % (2 * c) == 0]
    pps = [p for p in _divisors(devices) if p <= cfg.num_layers]
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        if global_batch % dp:
            dropped["batch"] += 1
            continue
        for mbs in space.micro_batch_sizes:
            if (global_batch // dp) % mbs:
                continue
            scheds = _schedules(cfg, pp, global_batch // (dp * mbs), space)
            dropped["pipeline"] += not scheds
            outer += [(tp, pp, cp, dp, mbs, s, v) for s, v in scheds]
    return _expand(outer, settings, space), dropped


def _expand(outer: list[tuple], settings: PlanSettings, space: SearchSpace) -> LayoutColumns:
    """Cross each outer row with its ZeRO stage/shard, sequence-parallel and recompute options."""
    policies = [AC_POLICIES.index(p) for p in space.activation_checkpointing
                if not (p == "selective" and settings.flash_attention)]
    rows: list[np.ndarray] = []
    inner_cache: dict[tuple[int, int], np.ndarray] = {}
    for tp, pp, cp, dp, mbs, sched, v in outer:
        key = (dp, tp)
        if key not in inner_cache:
            zero = [(0, dp, 1)] if 0 in space.zero_stages else []
            zero += [(z, dp // d, d) for z in space.zero_stages if z > 0
                     for d in _divisors(dp) if d > 1]
            sps = (0, 1) if tp > 1 else (0,)
            inner_cache[key] = np.array(
                [(z, r, d, sp, ac) for (z, r, d), sp, ac in itertools.product(zero, sps, policies)],
                dtype=np.int64,
            ).reshape(-1, 5)
        inner = inner_cache[key]
        base = np.tile(np.array([tp, pp, cp, mbs, sched, v], dtype=np.int64), (len(inner), 1))
        rows.append(np.concatenate([base, inner], axis=1))
    table = np.concatenate(rows) if rows else np.zeros((0, 11), dtype=np.int64)
    return LayoutColumns(
        tp=table[:, 0], pp=table[:, 1], cp=table[:, 2], micro_batch_size=table[:, 3],
        pp_schedule=table[:, 4], pp_virtual_stages=table[:, 5], zero_stage=table[:, 6],
        dp_replicate=table[:, 7], dp_shard=table[:, 8], sequence_parallel=table[:, 9].astype(bool),
        activation_checkpointing=table[:, 10],
    )


def search(cfg: ModelConfig, *, seq_len: int, global_batch: int, devices: int,
           cluster: ClusterSpec, settings: PlanSettings | None = None,
           space: SearchSpace | None = None) -> PlanResult:
    """Rank every fitting layout by predicted tokens/s; ``NoFeasibleLayoutError`` if none fits."""
    settings = settings or PlanSettings()
    space = space or SearchSpace()
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch),
                        ("devices", devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    start = time.perf_counter()
    cols, dropped = enumerate_layouts(cfg, seq_len, global_batch, devices, settings, space)
    if len(cols) == 0:
        raise NoFeasibleLayoutError(_explain_no_layout(cfg, seq_len, global_batch, devices,
                                                       dropped, space))
    metrics = evaluate(cfg, seq_len, global_batch, cols, cluster, settings)
    fits = metrics["fits"]
    if not fits.any():
        raise NoFeasibleLayoutError(_explain_memory(cols, metrics, cluster, settings, devices))
    order = np.flatnonzero(fits)
    order = order[np.lexsort((metrics["mem_total"][order], -metrics["tokens_per_s"][order]))]
    return PlanResult(
        cfg=cfg, seq_len=seq_len, global_batch=global_batch, devices=devices, cluster=cluster,
        settings=settings, layouts=cols.take(order),
        metrics={k: v[order] for k, v in metrics.items()}, num_candidates=len(cols),
        elapsed_s=time.perf_counter() - start,
    )


def _explain_no_layout(cfg, seq_len, global_batch, devices, dropped, space) -> str:
    if dropped["batch"] and not dropped["pipeline"]:
        dps = sorted({devices // (t * p * c) for t in _powers_of_two(space.max_tp)
                      for p in _divisors(devices) for c in _powers_of_two(space.max_cp)
                      if devices % (t * p * c) == 0 and p <= cfg.num_layers
                      and check_tensor_parallel(cfg, t) is None})
        return (f"global batch {global_batch} sequences cannot be split evenly: every layout of "
                f"{devices} devices leaves a data-parallel degree in {dps[:12]}, and none divides "
                f"the batch; use a batch that is a multiple of {dps[0]} or a device count that "
                f"divides into tp x pp x cp x dp with dp dividing {global_batch}")
    if dropped["pipeline"]:
        return (f"global batch {global_batch} is too small for every pipeline layout of {devices} "
                f"devices: each needs at least pp microbatches per data-parallel rank")
    return (f"{devices} devices cannot be factored as tp x pp x cp x dp for this model "
            f"(tp must divide num_heads={cfg.num_heads} and be a power of two <= {space.max_tp}; "
            f"pp <= num_layers={cfg.num_layers}; cp a power of two dividing seq_len/2={seq_len}/2)")


def _explain_memory(cols: LayoutColumns, metrics, cluster: ClusterSpec, settings: PlanSettings,
                    devices: int) -> str:
    usable = cluster.memory_bytes * settings.usable_memory_fraction
    states = metrics["mem_params"] + metrics["mem_grads"] + metrics["mem_optimizer"]
    i_states = int(np.argmin(states))
    i_act = int(np.argmin(metrics["mem_activations"] + metrics["mem_head"]))
    i_total = int(np.argmin(metrics["mem_total"]))
    best = cols.row(i_total)
    lines = [f"no layout of {devices} devices fits in {usable / GB:.1f} GB usable per "
             f"{cluster.name} ({settings.usable_memory_fraction:.0%} of "
             f"{cluster.memory_bytes / GB:.0f} GB); smallest footprint "
             f"{metrics['mem_total'][i_total] / GB:.1f} GB with {best.describe()}."]
    lay = cols.row(i_states)
    lines.append(
        f"Model states need at least {states[i_states] / GB:.1f} GB per device "
        f"(params {metrics['mem_params'][i_states] / GB:.1f} GB alone, at tp x pp = "
        f"{lay.tp * lay.pp}, ZeRO-{lay.zero_stage} over {lay.dp_shard})."
    )
    lay = cols.row(i_act)
    act = metrics["mem_activations"][i_act] + metrics["mem_head"][i_act]
    lines.append(f"Activations need at least {act / GB:.1f} GB per device ({lay.describe()}).")
    binding = "model states" if states[i_states] > usable else (
        "activations" if act > usable else "model states + activations together")
    lines.append(f"Binding constraint: {binding}; more devices, a smaller model, a shorter "
                 "sequence or a larger-memory accelerator would lift it.")
    return " ".join(lines)
