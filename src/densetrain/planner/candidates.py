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

from densetrain.errors import UserError
from densetrain.parallel.layout_check import RULES, RunShape, fields_read
from densetrain.planner.layout import AC_POLICIES, PP_SCHEDULES, LayoutColumns
from densetrain.values import is_int_at_least

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
        for name in ("max_tp", "max_cp"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise UserError(f"search space {name} must be a positive integer (1: no "
                                f"{name[4:]} split), got {value!r}")
        for name in ("micro_batch_sizes", "virtual_stages"):
            bad = [v for v in getattr(self, name)
                   if not is_int_at_least(v, 1)]
            if bad or not getattr(self, name):
                raise UserError(f"search space {name} must be positive integers, got "
                                f"{getattr(self, name)!r}")
        for name, allowed in (("schedules", PP_SCHEDULES),
                              ("activation_checkpointing", AC_POLICIES)):
            unknown = sorted(set(getattr(self, name)) - set(allowed))
            if unknown:
                raise UserError(f"search space {name} {unknown} unknown; allowed: {allowed}")


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


_OUTER = ("tp", "pp", "cp", "micro_batch_size", "pp_schedule", "pp_virtual_stages", "dp")
_INNER = ("zero_stage", "dp_replicate", "dp_shard", "sequence_parallel", "activation_checkpointing")
_KEY = ("tp", "pp", "cp", "dp")
_FIXED = ("pp_microbatches",)  # the search leaves it 0: microbatches = rank batch / mbs


def _outer_table(num_layers: int, global_batch: int, devices: int,
                 space: SearchSpace) -> np.ndarray:
    """Rows of (tp, pp, cp, mbs, schedule, v, dp) whose dp x mbs divides the batch."""
    outer = []
    for tp, pp, cp in itertools.product(powers_of_two(min(space.max_tp, devices)),
                                        [p for p in divisors(devices) if p <= num_layers],
                                        powers_of_two(min(space.max_cp, devices))):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        for mbs, (sched, v) in itertools.product(space.micro_batch_sizes, _schedules(pp, space)):
            if global_batch % (dp * mbs) == 0:
                outer.append((tp, pp, cp, mbs, sched, v, dp))
    return np.array(outer, dtype=np.int64).reshape(-1, len(_OUTER))


def _inner_table(dp: int, tp: int, cp: int, space: SearchSpace) -> np.ndarray:
    """Rows of (zero, dp_replicate, dp_shard, sp, ac) for one (tp, cp, dp). Plain data
    parallelism (zero 0) only without cp: with cp the trainer shards over cp (ZeRO-3)."""
    zero = [(0, dp, 1)] if 0 in space.zero_stages and cp == 1 else []
    zero += [(z, dp // d, d) for z in space.zero_stages if z > 0 for d in divisors(dp)
             if d > 1 or (z == 3 and cp > 1)]
    sps = (0, 1) if tp > 1 else (0,)
    policies = [AC_POLICIES.index(p) for p in space.activation_checkpointing]
    return np.array([(z, r, d, sp, ac) for (z, r, d), sp, ac
                     in itertools.product(zero, sps, policies)],
                    dtype=np.int64).reshape(-1, len(_INNER))


def _columns(table: np.ndarray, names: tuple[str, ...]) -> LayoutColumns:
    """``LayoutColumns`` of a table whose columns are ``names`` (dp derived, not stored)."""
    col = {n: table[:, i] for i, n in enumerate(names)}
    return LayoutColumns(
        tp=col["tp"], pp=col["pp"], cp=col["cp"], micro_batch_size=col["micro_batch_size"],
        pp_schedule=col["pp_schedule"], pp_virtual_stages=col["pp_virtual_stages"],
        zero_stage=col["zero_stage"], dp_replicate=col["dp_replicate"],
        dp_shard=col["dp_shard"], sequence_parallel=col["sequence_parallel"].astype(bool),
        activation_checkpointing=col["activation_checkpointing"],
    )


def _staged_rules(cfg, run: RunShape) -> tuple[list, list, list]:
    """The rules split by what they read: outer fields only, (tp, pp, cp, dp) and the inner
    fields only, and the rest (applied to the full rows)."""
    outer, inner, rest = [], [], []
    for rule in RULES:
        reads = fields_read(rule, cfg, run) - set(_FIXED)
        if reads <= set(_OUTER):
            outer.append(rule)
        elif reads <= set(_KEY) | set(_INNER):
            inner.append(rule)
        else:
            rest.append(rule)
    return outer, inner, rest


def _passes(rules: list, fields: SimpleNamespace, cfg, run: RunShape, n: int) -> np.ndarray:
    ok = np.ones(n, dtype=bool)
    for rule in rules:
        ok &= ~np.broadcast_to(np.asarray(rule.violated(fields, cfg, run), dtype=bool), (n,))
    return ok


def _probe_fields(table: np.ndarray, names: tuple[str, ...]) -> SimpleNamespace:
    col = {n: table[:, i] for i, n in enumerate(names)}
    if "dp" not in col:
        col["dp"] = col["dp_replicate"] * col["dp_shard"]
    if "pp_schedule" in col:
        col["pp_schedule"] = _SCHEDULE_NAMES[col["pp_schedule"]]
    if "zero_stage" in col:
        col["zero_stage"] = np.where(col["zero_stage"] == 0, 3, col["zero_stage"])
    if "sequence_parallel" in col:
        col["sequence_parallel"] = col["sequence_parallel"].astype(bool)
    return SimpleNamespace(**col, pp_microbatches=np.zeros(len(table), np.int64))


def all_layouts(cfg, global_batch: int, devices: int, space: SearchSpace,
                run: RunShape | None = None) -> LayoutColumns:
    """Every combination of the axes for ``devices``; with ``run``, only those passing the
    trainer's rules that read the outer or the inner fields alone (applied before the product
    of the two, which is what keeps a search over thousands of devices fast)."""
    outer = _outer_table(cfg.num_layers, global_batch, devices, space)
    staged = _staged_rules(cfg, run) if run is not None else ([], [], [])
    if run is not None and len(outer):
        outer = outer[_passes(staged[0], _probe_fields(outer, _OUTER), cfg, run, len(outer))]
    key_index = [_OUTER.index(k) for k in _KEY]
    keys, inverse = np.unique(outer[:, key_index], axis=0, return_inverse=True)
    order = np.argsort(inverse.reshape(-1), kind="stable")
    groups = np.split(order, np.cumsum(np.bincount(inverse.reshape(-1),
                                                   minlength=len(keys)))[:-1])
    blocks, tables = [], {}
    for k, (tp, pp, cp, dp) in enumerate(keys.tolist()):
        if (dp, tp, cp) not in tables:
            tables[dp, tp, cp] = _inner_table(dp, tp, cp, space)
        inner = tables[dp, tp, cp]
        if run is not None and len(inner):
            probe = np.concatenate([np.tile([tp, pp, cp], (len(inner), 1)), inner], axis=1)
            names = ("tp", "pp", "cp", *_INNER)
            inner = inner[_passes(staged[1], _probe_fields(probe, names), cfg, run, len(inner))]
        rows = outer[groups[k]][:, :-1]  # drop dp: the inner split holds it
        blocks.append(np.concatenate([np.repeat(rows, len(inner), axis=0),
                                      np.tile(inner, (len(rows), 1))], axis=1))
    width = len(_OUTER) - 1 + len(_INNER)
    table = np.concatenate(blocks) if blocks else np.zeros((0, width), dtype=np.int64)
    return _columns(table, _OUTER[:-1] + _INNER)


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
    run = RunShape(seq_len=seq_len, global_batch_size=global_batch, world_size=devices,
                   compile=compile)
    cols = all_layouts(cfg, global_batch, devices, space, run)
    ok = _passes(list(RULES), trainer_fields(cols), cfg, run, len(cols))
    if ok.any():
        return cols.take(ok), None
    everything = all_layouts(cfg, global_batch, devices, space)
    if len(everything) == 0:
        return everything, (f"global batch {global_batch} sequences cannot be split: no layout "
                            f"of {devices} devices leaves a data-parallel degree x micro-batch "
                            f"size {space.micro_batch_sizes} that divides it")
    return cols.take(ok), _explain(everything, rule_violations(everything, cfg, run), cfg, run,
                                   devices)


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
