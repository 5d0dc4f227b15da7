"""The layouts the search considers: every combination of degrees and options the trainer has,
kept only where `densetrain.parallel.layout_check` says the trainer runs it.

The axes: tp and cp powers of two, pp any divisor of the devices, dp the rest; each micro-batch
size; every pipeline schedule of ``parallel.config.PP_SCHEDULES`` (interleaved ones with each
virtual-stage count, ZB-V with its two); ZeRO stage and the replicate x shard split of dp
(stage 3 also sharded over cp alone); sequence parallel on or off; every activation-checkpointing
policy. The trainer's rules then drop what it would refuse, so the search never ranks a layout
that a config could not run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from densetrain.parallel.layout_check import RULES, RunShape
from densetrain.planner.layout import AC_POLICIES, PP_SCHEDULES, LayoutColumns

_SCHEDULE_NAMES = np.asarray(PP_SCHEDULES)


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

    def __post_init__(self) -> None:
        for name, allowed in (("schedules", PP_SCHEDULES),
                              ("activation_checkpointing", AC_POLICIES)):
            unknown = sorted(set(getattr(self, name)) - set(allowed))
            if unknown:
                raise ValueError(f"search space {name} {unknown} unknown; allowed: {allowed}")


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``."""
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _schedules(pp: int, space: SearchSpace) -> list[tuple[int, int]]:
    if pp == 1:
        return [(PP_SCHEDULES.index("1f1b"), 1)]
    out = []
    for name in space.schedules:
        if name == "zbv":
            out.append((PP_SCHEDULES.index(name), 2))
        elif name in ("interleaved_1f1b", "zero_bubble"):
            out += [(PP_SCHEDULES.index(name), v) for v in space.virtual_stages]
        else:
            out.append((PP_SCHEDULES.index(name), 1))
    return out


def _inner_options(dp: int, tp: int, cp: int, space: SearchSpace) -> np.ndarray:
    """(zero, dp_replicate, dp_shard, sp, ac) rows for one outer layout."""
    zero = [(0, dp, 1)] if 0 in space.zero_stages else []
    zero += [(z, dp // d, d) for z in space.zero_stages if z > 0 for d in divisors(dp)
             if d > 1 or (z == 3 and cp > 1)]
    sps = (0, 1) if tp > 1 else (0,)
    policies = [AC_POLICIES.index(p) for p in space.activation_checkpointing]
    return np.array([(z, r, d, sp, ac) for (z, r, d), sp, ac
                     in itertools.product(zero, sps, policies)], dtype=np.int64).reshape(-1, 5)


def all_layouts(num_layers: int, global_batch: int, devices: int,
                space: SearchSpace) -> LayoutColumns:
    """Every combination of the axes for ``devices`` (before the trainer's rules)."""
    outer = []  # (tp, pp, cp, mbs, schedule, v, dp)
    for tp, pp, cp in itertools.product(powers_of_two(min(space.max_tp, devices)),
                                        [p for p in divisors(devices) if p <= num_layers],
                                        powers_of_two(min(space.max_cp, devices))):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        for mbs, (sched, v) in itertools.product(space.micro_batch_sizes, _schedules(pp, space)):
            if global_batch % (dp * mbs) == 0:
                outer.append((tp, pp, cp, mbs, sched, v, dp))
    rows, cache = [], {}
    for tp, pp, cp, mbs, sched, v, dp in outer:
        key = (dp, tp, cp)
        if key not in cache:
            cache[key] = _inner_options(dp, tp, cp, space)
        inner = cache[key]
        base = np.tile(np.array([tp, pp, cp, mbs, sched, v], dtype=np.int64), (len(inner), 1))
        rows.append(np.concatenate([base, inner], axis=1))
    table = np.concatenate(rows) if rows else np.zeros((0, 11), dtype=np.int64)
    return LayoutColumns(
        tp=table[:, 0], pp=table[:, 1], cp=table[:, 2], micro_batch_size=table[:, 3],
        pp_schedule=table[:, 4], pp_virtual_stages=table[:, 5], zero_stage=table[:, 6],
        dp_replicate=table[:, 7], dp_shard=table[:, 8], sequence_parallel=table[:, 9].astype(bool),
        activation_checkpointing=table[:, 10],
    )


def trainer_fields(cols: LayoutColumns) -> SimpleNamespace:
    """The columns as the trainer's ``[parallel]`` fields (see ``Layout.to_parallel_config``)."""
    return SimpleNamespace(
        tp=cols.tp, pp=cols.pp, cp=cols.cp, dp_replicate=cols.dp_replicate,
        dp_shard=cols.dp_shard, dp=cols.dp, micro_batch_size=cols.micro_batch_size,
        zero_stage=np.where(cols.zero_stage == 0, 3, cols.zero_stage),
        sequence_parallel=cols.sequence_parallel, pp_schedule=_SCHEDULE_NAMES[cols.pp_schedule],
        pp_virtual_stages=cols.pp_virtual_stages, pp_microbatches=np.zeros(len(cols), np.int64),
    )


def rule_violations(cols: LayoutColumns, cfg, run: RunShape) -> dict[str, np.ndarray]:
    """For each trainer rule, which rows break it."""
    fields = trainer_fields(cols)
    return {rule.name: np.broadcast_to(np.asarray(rule.violated(fields, cfg, run), dtype=bool),
                                       (len(cols),)) for rule in RULES}


def runnable_layouts(cfg, seq_len: int, global_batch: int, devices: int, space: SearchSpace,
                     *, compile: bool = False) -> tuple[LayoutColumns, str | None]:
    """The layouts the trainer runs, and when there are none a sentence saying why."""
    cols = all_layouts(cfg.num_layers, global_batch, devices, space)
    run = RunShape(seq_len=seq_len, global_batch_size=global_batch, world_size=devices,
                   compile=compile)
    if len(cols) == 0:
        return cols, (f"global batch {global_batch} sequences cannot be split: no layout of "
                      f"{devices} devices leaves a data-parallel degree x micro-batch size "
                      f"{space.micro_batch_sizes} that divides it")
    violations = rule_violations(cols, cfg, run)
    ok = np.ones(len(cols), dtype=bool)
    for broken in violations.values():
        ok &= ~broken
    if ok.any():
        return cols.take(ok), None
    return cols.take(ok), _explain(cols, violations, cfg, run, devices)


def _explain(cols: LayoutColumns, violations: dict[str, np.ndarray], cfg, run: RunShape,
             devices: int) -> str:
    by_rule = {r.name: r for r in RULES}
    counts = sorted(((int(v.sum()), name) for name, v in violations.items() if v.any()),
                    reverse=True)
    fields = trainer_fields(cols)
    parts = []
    for count, name in counts[:3]:
        i = int(np.flatnonzero(violations[name])[0])
        row = SimpleNamespace(**{k: v[i].item() for k, v in vars(fields).items()})
        parts.append(f"{by_rule[name].reason(row, cfg, run)} ({count:,} layouts)")
    return (f"none of the {len(cols):,} layouts of {devices} devices runs in the trainer; the "
            "rules most often broken: " + "; ".join(parts))
