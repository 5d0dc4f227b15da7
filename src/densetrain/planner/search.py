"""Layout search: enumerate every layout a model, batch and device count allow, evaluate them
all at once (numpy columns), keep those that fit in memory and rank them by tokens/s.

When nothing can serve the request, ``NoFeasibleLayoutError`` says which constraint binds
(divisibility of devices or batch, or memory and by which component) instead of returning an
empty table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.parallel.layout_check import check_layout
from densetrain.planner.candidates import SearchSpace, runnable_layouts
from densetrain.planner.comm import comm_columns
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import Layout, LayoutColumns, PlanSettings
from densetrain.planner.memory import memory_columns
from densetrain.planner.timing import time_columns
from densetrain.values import is_int_at_least

GB = 1e9


class NoFeasibleLayoutError(UserError):
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
                    cluster: ClusterSpec, settings: PlanSettings | None = None, *,
                   trainer_rules: bool = True) -> dict[str, float]:
    """Every metric of one layout (``ValueError`` if the trainer cannot run it: the reasons of
    ``parallel.layout_check.check_layout``). ``trainer_rules=False`` models a layout another
    system ran (a published one) without asking whether densetrain's trainer runs it."""
    layout.num_microbatches(global_batch)
    problems = layout_problems(cfg, layout, seq_len=seq_len, global_batch=global_batch)
    if problems and trainer_rules:
        raise UserError("layout: " + "; ".join(problems))
    cols = LayoutColumns.from_layouts([layout])
    out = evaluate(cfg, seq_len, global_batch, cols, cluster, settings or PlanSettings())
    return {k: float(v[0]) for k, v in out.items()}


def layout_problems(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                    global_batch: int) -> list[str]:
    """Why the trainer cannot run ``layout`` for this model and batch (empty: it can)."""
    from types import SimpleNamespace

    parallel = SimpleNamespace(**layout.to_parallel_config(), pp_microbatches=0,
                               pp_layer_split=[])
    return check_layout(parallel, cfg, seq_len=seq_len, global_batch_size=global_batch,
                        micro_batch_size=layout.micro_batch_size, world_size=layout.devices)


def search(cfg: ModelConfig, *, seq_len: int, global_batch: int, devices: int,
           cluster: ClusterSpec, settings: PlanSettings | None = None,
           space: SearchSpace | None = None) -> PlanResult:
    """Rank every fitting layout by predicted tokens/s; ``NoFeasibleLayoutError`` if none fits."""
    settings = settings or PlanSettings()
    space = space or SearchSpace()
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch),
                        ("devices", devices)):
        if not is_int_at_least(value, 1):
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    start = time.perf_counter()
    cols, why_none = runnable_layouts(cfg, seq_len, global_batch, devices, space)
    if len(cols) == 0:
        raise NoFeasibleLayoutError(why_none)
    metrics = evaluate(cfg, seq_len, global_batch, cols, cluster, settings)
    fits = metrics["fits"]
    if not fits.any():
        raise NoFeasibleLayoutError(_explain_memory(cols, metrics, cluster, settings, devices))
    order = np.flatnonzero(fits)
    # Equal predicted speed (communication the model hides behind compute): the layout that
    # moves fewer bytes first, as it leans least on that overlap, then the smaller footprint
    # (report.explain_runners_up says which of the two picked the winner).
    traffic = traffic_bytes(metrics)
    order = order[np.lexsort((metrics["mem_total"][order], traffic[order],
                              -metrics["tokens_per_s"][order]))]
    return PlanResult(
        cfg=cfg, seq_len=seq_len, global_batch=global_batch, devices=devices, cluster=cluster,
        settings=settings, layouts=cols.take(order),
        metrics={k: v[order] for k, v in metrics.items()}, num_candidates=len(cols),
        elapsed_s=time.perf_counter() - start,
    )


def traffic_bytes(metrics):
    """Bytes a device sends per step over all parallel dimensions: of one row (a dict of
    numbers) or of every layout (the search's dict of arrays)."""
    return sum(metrics[f"{kind}_bytes"] for kind in ("tp", "dp", "pp", "cp"))


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
