"""`check_layout`: the one statement of which parallel layouts the trainer runs.

Every rule is a predicate over the layout's degrees and options, the model's architecture and
the run's shape (sequence length, batch, world size, compile, document masking), plus the
sentence a user sees when it is violated. A layout is resolved once (`resolve_layout`: the
frozen `ResolvedLayout` of degrees, data-parallel kind, microbatches, kv split, batch sizes),
and the same predicates serve its callers:

- `check_layout(parallel, model, ...)` resolves one ``ParallelConfig`` and returns the reasons
  it cannot run (empty: runnable) — for job validation (``config.rules.validate_job``, which
  the trainer runs before any process group starts); `layout_reasons(layout, model)` checks a
  `ResolvedLayout` (the trainer's, once, where the run is built:
  ``ParallelMesh.with_layout``), after which the builders read the layout and check nothing;
- `require(names, layout, ...)` raises the reason of the named rules — the guard of a builder
  called directly, without a checked layout (``data_parallel_kind``,
  ``apply_tensor_parallel``, the pipeline builders), on the layout of what it was handed
  (`layout_on_mesh`, `degrees_layout`);
- `runnable_mask(columns, model, ...)` evaluates them elementwise on numpy columns of many
  layouts at once — for the planner's search, so that it never advises a layout this module
  refuses.

Pure Python (numpy only for columns); nothing here imports torch or builds a model. The rules
and where each comes from:

- degrees: multiply to the world size (``dp_shard=-1`` takes the rest);
- pipeline options: virtual stages only with interleaved schedules, ``zbv`` exactly 2, explicit
  ``pp_microbatches`` >= pp except for GPipe, ``pp_layer_split`` has pp x v entries summing to
  the layers, at most one stage per layer;
- tensor parallel: tp divides the heads and the ffn width, tp divides the kv heads or is a
  multiple of them (the plan covers every block, position and embedding feature of the
  models: pre- and post-norm, sequential or parallel blocks, QK-norm, embedding norms and
  projections, tied or untied heads, learned, rotary, ALiBi or Transformer-XL positions);
- sequence parallel: the per-cp-rank sequence is a multiple of tp;
- context parallel: the sequence is a multiple of 2 x cp (load-balanced chunks); ALiBi, sliding
  windows, document masks and Transformer-XL relative positions are masked by global positions;
- float8 training (``training.dtype=float8``): tp = 1 (no float8 tensor-parallel plans);
- data parallel: ZeRO-1/2 only on pure data parallelism (dp_shard, no tp/pp/cp/dp_replicate);
  replicated DP without sharding (DDP) not with tp or pp;
- batch: the global batch splits into dp x micro_batch_size; pipeline microbatches divide the
  rank's batch and are >= pp except for GPipe; interleaved schedules need a whole number of
  rounds (torch.distributed.pipelining: m is a multiple of max(1, m // pp));
- pipeline composes with ZeRO-3 only, not with ``compile``, tied embeddings not with the
  ``zbv`` schedule, no document masks, a constant batch (no batch-size ramp).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from densetrain.errors import UserError
from densetrain.values import is_int_at_least

INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "zero_bubble", "zbv")
"""Schedules that hold several stages per pipeline rank (``pp_virtual_stages``)."""


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """What the layout must serve: the batch shape, the world and the run's switches."""

    seq_len: int
    global_batch_size: int
    world_size: int
    compile: bool = False
    document_masking: bool = False
    batch_ramp: bool = False
    """The global batch grows during the run (``schedule.batch_ramp_start > 0``)."""
    float8: bool = False
    """The blocks' linear layers run in float8 (``training.dtype=float8``)."""
    bf16_params: bool = False
    """The layers compute in bf16 copies of fp32 parameters (``training.dtype=bf16`` with
    ``parallel.param_dtype=compute``): without sharded data parallelism, FSDP2 over one-rank
    shards (`parallel.parallelize.single_rank_fsdp`), which also replicates."""


@dataclass(frozen=True)
class Rule:
    """One requirement: ``violated(f, m, r)`` is true (elementwise) when the layout breaks it;
    ``reason(f, m, r)`` is the sentence for one scalar layout that breaks it."""

    name: str
    violated: Callable[[Any, Any, RunShape], Any]
    reason: Callable[[Any, Any, RunShape], str]


def _select(cond: Any, a: Any, b: Any) -> Any:
    """``a if cond else b`` for scalars, ``np.where`` for columns."""
    if getattr(cond, "ndim", 0):
        import numpy as np

        return np.where(cond, a, b)
    return a if cond else b


def _one_of(value: Any, names: tuple[str, ...]) -> Any:
    out = value == names[0]
    for name in names[1:]:
        out = out | (value == name)
    return out


class DataParallelKind(str, enum.Enum):
    """How a layout synchronises gradients over its data-parallel ranks."""

    NONE = "none"
    DDP = "ddp"
    ZERO12 = "zero12"  # ZeRO-1/2: optimizer state (and gradients) sharded, parameters whole
    FSDP = "fsdp"
    HSDP = "hsdp"

    @classmethod
    def of(cls, *, dp_replicate: int, fsdp_size: int, zero_stage: int) -> DataParallelKind:
        """The kind of a layout with these degrees (``fsdp_size``: the sharding group's size,
        dp_shard x cp) and ZeRO stage."""
        if fsdp_size == 1:
            return cls.NONE if dp_replicate == 1 else cls.DDP
        if zero_stage < 3:
            return cls.ZERO12
        return cls.HSDP if dp_replicate > 1 else cls.FSDP

    @property
    def replica_axis(self) -> str | None:
        """The mesh axis whose ranks hold identical parameters, or None."""
        return {"ddp": "dp_replicate", "hsdp": "dp_replicate", "zero12": "dp_shard"}.get(
            self.value)


def pipeline_microbatches(pp_microbatches: Any, pp: Any, local_batch: Any,
                          micro_batch_size: Any) -> Any:
    """Pipeline microbatches per step, the one statement of the default: ``pp_microbatches``
    when set (> 0); else the rank's batch over ``micro_batch_size`` (so a microbatch holds the
    usual number of sequences); else, while the micro-batch size is still to be derived
    (``micro_batch_size = 0``), ``pp`` (at least two microbatches fill a two-stage pipeline).
    Elementwise on numpy columns."""
    by_micro = local_batch // _select(micro_batch_size > 0, micro_batch_size, 1)
    default = _select(micro_batch_size > 0, by_micro, pp)
    return _select(pp_microbatches > 0, pp_microbatches, default)


def kv_split(num_kv_heads: Any, tp: Any) -> Any:
    """The ways tensor parallelism splits the kv heads, and with them the k and v projections
    and their outputs: ``tp`` when it divides them, else 1. With fewer kv heads than tp ranks
    (tp a multiple of them, rule ``tp_and_kv_heads``) every rank keeps the whole projections,
    computes all of their outputs and keeps its own head's columns (``parallel.tensor``), so
    the parameters, FLOPs and activations are those of no split. Elementwise on columns."""
    return _select(num_kv_heads % tp == 0, tp, 1)


def _microbatches(f: Any, r: RunShape) -> Any:
    """`pipeline_microbatches` of a layout, at least 1 so that it can be divided by."""
    local = r.global_batch_size // f.dp
    count = pipeline_microbatches(f.pp_microbatches, f.pp, local, f.micro_batch_size)
    return _select(count > 0, count, 1)


def _rounds_ok(f: Any, r: RunShape) -> Any:
    count = _microbatches(f, r)
    rounds = _select(count // f.pp > 1, count // f.pp, 1)
    return count % rounds == 0


RULES: tuple[Rule, ...] = (
    Rule("virtual_stages_need_interleaved",
         lambda f, m, r: (f.pp_virtual_stages > 1)
         & (_one_of(f.pp_schedule, INTERLEAVED_SCHEDULES) == False),  # noqa: E712
         lambda f, m, r: f"parallel.pp_virtual_stages={f.pp_virtual_stages} needs an interleaved "
         f"pp_schedule (interleaved_1f1b, zero_bubble, zbv), got {f.pp_schedule!r}"),
    Rule("zbv_two_stages",
         lambda f, m, r: (f.pp_schedule == "zbv") & (f.pp_virtual_stages != 2),
         lambda f, m, r: 'parallel.pp_schedule="zbv" runs exactly 2 stages per rank; set '
         f"pp_virtual_stages=2 (got {f.pp_virtual_stages})"),
    Rule("explicit_microbatches_fill_pipeline",
         lambda f, m, r: (f.pp > 1) & (f.pp_schedule != "gpipe") & (f.pp_microbatches > 0)
         & (f.pp_microbatches < f.pp),
         lambda f, m, r: f"parallel.pp_microbatches={f.pp_microbatches} must be >= pp={f.pp} for "
         f"pp_schedule={f.pp_schedule!r} (only gpipe runs fewer microbatches than stages)"),
    Rule("tp_divides_heads",
         lambda f, m, r: m.num_heads % f.tp != 0,
         lambda f, m, r: f"parallel.tp={f.tp} must divide the attention heads "
         f"(model.num_heads={m.num_heads})"),
    Rule("tp_and_kv_heads",
         lambda f, m, r: (m.num_kv_heads % f.tp != 0) & (f.tp % m.num_kv_heads != 0),
         lambda f, m, r: f"parallel.tp={f.tp} must divide model.num_kv_heads={m.num_kv_heads} "
         "(kv heads split across ranks) or be a multiple of it (kv heads replicated)"),
    Rule("tp_divides_ffn",
         lambda f, m, r: m.ffn_dim % f.tp != 0,
         lambda f, m, r: f"parallel.tp={f.tp} must divide model.ffn_dim={m.ffn_dim}"),
    Rule("sp_sequence_divides",
         lambda f, m, r: f.sequence_parallel & (f.tp > 1) & ((r.seq_len // f.cp) % f.tp != 0),
         lambda f, m, r: f"sequence parallel with parallel.tp={f.tp} needs the sequence length "
         f"per cp rank ({r.seq_len} / cp={f.cp} = {r.seq_len // f.cp}) to be a multiple of tp"),
    Rule("cp_sequence_chunks",
         lambda f, m, r: (f.cp > 1) & (r.seq_len % (2 * f.cp) != 0),
         lambda f, m, r: f"parallel.cp={f.cp} needs the sequence length {r.seq_len} to be a "
         f"multiple of 2 x cp = {2 * f.cp} (each cp rank holds two chunks that balance the "
         "causal mask)"),
    Rule("float8_without_tp",
         lambda f, m, r: (f.tp > 1) & r.float8,
         lambda f, m, r: f"parallel.tp={f.tp}: training.dtype=float8 runs with tp=1 only (the "
         "tensor-parallel plans have no float8 linear layers); use dp_shard, pp or cp, or "
         "training.dtype=bf16"),
    Rule("pp_stages_have_layers",
         lambda f, m, r: f.pp * f.pp_virtual_stages > m.num_layers,
         lambda f, m, r: f"parallel.pp={f.pp} x pp_virtual_stages={f.pp_virtual_stages} = "
         f"{f.pp * f.pp_virtual_stages} stages exceed model.num_layers={m.num_layers} "
         "(each stage needs at least one layer)"),
    Rule("zero12_pure_dp",
         lambda f, m, r: (f.dp_shard * f.cp > 1) & (f.zero_stage < 3)
         & ((f.tp > 1) | (f.pp > 1) | (f.cp > 1) | (f.dp_replicate > 1)),
         lambda f, m, r: f"parallel.zero_stage={f.zero_stage} runs on pure data parallel "
         "(dp_shard only); use zero_stage=3 to compose with tp, pp, cp or dp_replicate"),
    # DDP (torch's replicate) does not compose with tensor or pipeline parallel; replicas of
    # one-rank FSDP shards, which bf16 parameters use, do (HSDP)
    Rule("ddp_without_tp_pp",
         lambda f, m, r: (f.dp_shard * f.cp == 1) & (f.dp_replicate > 1) & ((f.tp > 1)
                                                                          | (f.pp > 1))
         & (not r.bf16_params),
         lambda f, m, r: f"parallel.dp_replicate={f.dp_replicate} with tp={f.tp}, pp={f.pp} and "
         "dp_shard=1 runs with bf16 parameters only (training.dtype=bf16 with "
         "parallel.param_dtype=compute); else use dp_shard (FSDP) for the data-parallel degree"),
    Rule("batch_splits",
         lambda f, m, r: r.global_batch_size % (f.dp * f.micro_batch_size) != 0,
         lambda f, m, r: f"training.global_batch_size={r.global_batch_size} is not divisible by "
         f"training.micro_batch_size x data-parallel size = {f.micro_batch_size} x {f.dp} = "
         f"{f.micro_batch_size * f.dp}; choose a multiple of {f.micro_batch_size * f.dp} "
         "(gradient accumulation steps = global / (micro x dp))"),
    Rule("pp_microbatches_divide_batch",
         lambda f, m, r: (f.pp > 1) & ((r.global_batch_size // f.dp) % _microbatches(f, r) != 0),
         lambda f, m, r: f"parallel.pp={f.pp}: the rank's batch of {r.global_batch_size // f.dp} "
         f"sequences does not split into {_microbatches(f, r)} pipeline microbatches; set "
         "parallel.pp_microbatches to a divisor"),
    Rule("pp_microbatches_fill_pipeline",
         lambda f, m, r: (f.pp > 1) & (f.pp_schedule != "gpipe") & (_microbatches(f, r) < f.pp),
         lambda f, m, r: f"parallel.pp={f.pp} with pp_schedule={f.pp_schedule!r} needs at least "
         f"pp microbatches per step, got {_microbatches(f, r)} (rank batch "
         f"{r.global_batch_size // f.dp} / training.micro_batch_size={f.micro_batch_size}); "
         "lower training.micro_batch_size or set parallel.pp_microbatches"),
    Rule("pp_interleaved_rounds",
         lambda f, m, r: (f.pp > 1) & _one_of(f.pp_schedule, ("interleaved_1f1b", "zero_bubble"))
         & (_rounds_ok(f, r) == False),  # noqa: E712
         lambda f, m, r: f"parallel.pp_schedule={f.pp_schedule!r} needs the microbatches "
         f"({_microbatches(f, r)}) to be a multiple of the rounds max(1, m // pp = "
         f"{_microbatches(f, r) // f.pp})"),
    Rule("pp_needs_zero3",
         lambda f, m, r: (f.pp > 1) & (f.zero_stage < 3),
         lambda f, m, r: f"parallel.pp={f.pp} composes with parallel.zero_stage=3 (FSDP) only, "
         f"got zero_stage={f.zero_stage}"),
    Rule("pp_without_compile",
         lambda f, m, r: (f.pp > 1) & r.compile,
         lambda f, m, r: f"training.compile is not supported with parallel.pp={f.pp}"),
    # Tied embeddings keep a copy of the matrix on the last stage and sum the two copies'
    # gradients between the first and last pp rank (`parallel.pipeline`); the V schedule puts
    # both stages on one rank, where the copies would need a local sum instead.
    Rule("pp_tied_without_zbv",
         lambda f, m, r: (f.pp > 1) & (f.pp_schedule == "zbv") & bool(m.tie_embeddings),
         lambda f, m, r: f'parallel.pp={f.pp} with pp_schedule="zbv" needs untied embeddings '
         "(model.tie_embeddings=False): the V schedule holds the first and last stage on one "
         "rank; tied embeddings run with the other schedules"),
    # A pipeline's stages fix their send/receive shapes at the first step; a growing batch
    # changes the microbatch shape (gloo then fails on the size mismatch).
    Rule("pp_constant_batch",
         lambda f, m, r: (f.pp > 1) & r.batch_ramp,
         lambda f, m, r: f"parallel.pp={f.pp} needs a constant batch: the pipeline fixes its "
         "microbatch shapes at the first step; set schedule.batch_ramp_start=0 or use no "
         "pipeline"),
    Rule("pp_plain_causal",
         lambda f, m, r: (f.pp > 1) & r.document_masking,
         lambda f, m, r: f"parallel.pp={f.pp} runs the plain causal mask only; turn off "
         "data.document_masking"),
)


CONFIG_RULES = ("virtual_stages_need_interleaved", "zbv_two_stages",
                "explicit_microbatches_fill_pipeline")
"""The rules a ``[parallel]`` section alone decides (no model, batch or world needed)."""


def config_reasons(parallel: Any) -> list[str]:
    """Why the ``[parallel]`` options contradict each other (``CONFIG_RULES``); empty if not."""
    return [rule.reason(parallel, None, None) for rule in RULES
            if rule.name in CONFIG_RULES and rule.violated(parallel, None, None)]


class _Reads(SimpleNamespace):
    """A probe layout that records which fields a rule reads."""

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("__"):
            object.__getattribute__(self, "_seen").add(name)
        return object.__getattribute__(self, name)


def fields_read(rule: Rule, model: Any, run: RunShape) -> frozenset[str]:
    """The layout fields ``rule`` reads (every predicate evaluates all its terms: ``&``, ``|``
    and `_select` do not short-circuit), so that a search can apply it before expanding the
    fields it does not read."""
    probe = _Reads(_seen=set(), dp_replicate=1, dp_shard=1, dp=1, tp=1, pp=2, cp=1,
                   zero_stage=3, sequence_parallel=False, pp_schedule="1f1b",
                   pp_microbatches=0, pp_virtual_stages=1, micro_batch_size=1)
    rule.violated(probe, model, run)
    return frozenset(object.__getattribute__(probe, "_seen"))


def balanced_split(num_layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage when ``pp_layer_split`` is empty: ``num_layers // stages``
    each, and the remainder one layer each to the middle stages, the later first, then to the
    last stage; the first stage never takes one. The first stage holds the token embedding and
    the most microbatches in flight (1F1B: pp of them), the last the output head and the loss;
    the later a middle stage, the fewer microbatches it holds. Llama 3 405B's 126 layers on 16
    stages split 7, 8 x 14, 7, the paper's own (Dubey et al. 2024 §3.3.2: one layer fewer on
    the first and the last stage)."""
    base, extra = divmod(num_layers, stages)
    split = [base] * stages
    order = [*range(stages - 2, 0, -1), stages - 1, 0] if stages > 1 else [0]
    for stage in order[:extra]:
        split[stage] += 1
    return split


def layer_split_reasons(split: list[int], stages: int, num_layers: int) -> list[str]:
    """Why an explicit ``pp_layer_split`` cannot split ``num_layers`` over ``stages`` stages
    (empty: it can, or it is empty and the trainer balances the layers)."""
    split = list(split)
    if split and (len(split) != stages or sum(split) != num_layers):
        return [f"parallel.pp_layer_split={split} must have pp x pp_virtual_stages = {stages} "
                f"entries summing to model.num_layers={num_layers}"]
    return []


def resolve_dp_shard(parallel: Any, world_size: int) -> tuple[int | None, str | None]:
    """(dp_shard with -1 resolved, None) or (None, why the degrees do not fit ``world_size``)."""
    others = parallel.dp_replicate * parallel.cp * parallel.tp * parallel.pp
    if not is_int_at_least(world_size, 1):
        return None, f"the world size must be a positive integer, got {world_size!r}"
    if parallel.dp_shard == -1:
        if world_size % others:
            return None, (f"parallel degrees dp_replicate={parallel.dp_replicate} x "
                          f"cp={parallel.cp} x tp={parallel.tp} x pp={parallel.pp} = {others} do "
                          f"not divide the world size {world_size}; dp_shard=-1 needs world_size "
                          "to be a multiple of their product" + _launch_hint(world_size, others))
        return world_size // others, None
    if others * parallel.dp_shard != world_size:
        needed = others * parallel.dp_shard
        return None, (f"parallel degrees must multiply to the world size: dp_replicate="
                      f"{parallel.dp_replicate} x dp_shard={parallel.dp_shard} x cp={parallel.cp}"
                      f" x tp={parallel.tp} x pp={parallel.pp} = {needed}, "
                      f"but world_size = {world_size}" + _launch_hint(world_size, needed))
    return parallel.dp_shard, None


def _launch_hint(world_size: int, needed: int) -> str:
    """How to start ``needed`` processes, when the run was started as one."""
    if world_size != 1 or needed < 2:
        return ""
    return (f"; this is one process: start {needed} with `torchrun --standalone "
            f"--nproc-per-node={needed} -m densetrain train ...`")


@dataclass(frozen=True, kw_only=True)
class ResolvedLayout:
    """One layout, resolved once for one run: its degrees (``dp_shard`` resolved), its options
    and every number derived from them, each by its one definition in this module. The builders
    (`parallel.build.build_model`, `parallel.parallelize.parallelize`, the optimizer builder,
    the pipeline builder, `train.sdc.replica_axis`) read these fields instead of deriving them
    again; the rules (`RULES`) read them too, so `layout_reasons` checks this very object.

    Made by `resolve_layout` (a config on a world) or `layout_on_mesh` (the degrees of a mesh
    and a config's options, for a builder called directly); a run attaches its checked one to
    its mesh (`parallel.mesh.ParallelMesh.with_layout`).
    """

    world_size: int
    dp_replicate: int
    dp_shard: int
    """Resolved: never -1."""
    cp: int
    tp: int
    pp: int
    pp_virtual_stages: int
    zero_stage: int
    sequence_parallel: bool
    pp_schedule: str
    pp_microbatches: int
    """As configured (0: the default of `pipeline_microbatches`); the count is `microbatches`."""
    pp_layer_split: tuple[int, ...]
    """Layers per stage as configured (empty: balanced, `parallel.pipeline.layer_split`)."""
    data_parallel: DataParallelKind
    local_batch: int
    """Sequences per data-parallel rank per step (global batch over dp)."""
    micro_batch_size: int
    """Sequences per micro-batch (0: still to be derived; the rules that read it are skipped)."""
    microbatches: int
    """Pipeline microbatches per step (`pipeline_microbatches`; with pp = 1 the number of
    micro-batches the rank's batch splits into)."""
    kv_split: int | None
    """Ways tensor parallelism splits the kv heads (`kv_split`); None without a model."""
    run: RunShape
    """The run the layout serves (sequence length, global batch, world, switches)."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different batches (dp_replicate x dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that FSDP or ZeRO shard over (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def num_stages(self) -> int:
        """Pipeline stages over all pp ranks (pp x pp_virtual_stages)."""
        return self.pp * self.pp_virtual_stages


def resolve_layout(parallel_cfg: Any, model_cfg: Any, *, world_size: int, seq_len: int,
                   global_batch_size: int, micro_batch_size: int, compile: bool = False,
                   document_masking: bool = False, batch_ramp: bool = False,
                   float8: bool = False, bf16_params: bool = False) -> ResolvedLayout:
    """The `ResolvedLayout` of ``parallel_cfg`` (a ``ParallelConfig``) training ``model_cfg``
    (None: no kv split) on ``world_size`` ranks. Pure: it checks nothing but the degrees
    (``UserError`` when they do not fit the world, `resolve_dp_shard`); `layout_reasons` says
    whether the trainer runs it."""
    dp_shard, problem = resolve_dp_shard(parallel_cfg, world_size)
    if problem:
        raise UserError(problem)
    return _resolved(parallel_cfg, model_cfg, dp_replicate=parallel_cfg.dp_replicate,
                     dp_shard=dp_shard, cp=parallel_cfg.cp, tp=parallel_cfg.tp,
                     pp=parallel_cfg.pp,
                     run=RunShape(seq_len=seq_len, global_batch_size=global_batch_size,
                                  world_size=world_size, compile=compile,
                                  document_masking=document_masking, batch_ramp=batch_ramp,
                                  float8=float8, bf16_params=bf16_params),
                     micro_batch_size=micro_batch_size)


def layout_on_mesh(dims: Any, parallel_cfg: Any, model_cfg: Any = None, *,
                   local_batch_size: int = 0, micro_batch_size: int = 0, compile: bool = False,
                   float8: bool = False) -> ResolvedLayout:
    """The layout a builder called directly lays out: the degrees of ``dims`` (a
    ``ParallelDims``, already resolved) with ``parallel_cfg``'s options, serving
    ``local_batch_size`` sequences per data-parallel rank (0: unknown). Unchecked: the builder
    requires the rules it relies on (`require`)."""
    run = RunShape(seq_len=0, global_batch_size=local_batch_size * dims.dp_size,
                   world_size=dims.world_size, compile=compile, float8=float8)
    return _resolved(parallel_cfg, model_cfg, dp_replicate=dims.dp_replicate,
                     dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp, pp=dims.pp, run=run,
                     micro_batch_size=micro_batch_size)


def degrees_layout(model_cfg: Any = None, **degrees: int) -> ResolvedLayout:
    """The layout of ``degrees`` alone (every other degree 1, default options, no batch): what
    a builder handed one sub-mesh or a stage count lays out (`apply_tensor_parallel`'s tp mesh,
    `parallel.pipeline.layer_split`'s stages, the planner's tp), for the rules of that part."""
    from densetrain.parallel.config import ParallelConfig

    cfg = ParallelConfig(**{"dp_shard": 1, **degrees})
    world = cfg.dp_replicate * cfg.dp_shard * cfg.cp * cfg.tp * cfg.pp
    return resolve_layout(cfg, model_cfg, world_size=world, seq_len=0, global_batch_size=0,
                          micro_batch_size=0)


def _resolved(cfg: Any, model: Any, *, dp_replicate: int, dp_shard: int, cp: int, tp: int,
              pp: int, run: RunShape, micro_batch_size: int) -> ResolvedLayout:
    local = run.global_batch_size // (dp_replicate * dp_shard)
    return ResolvedLayout(
        world_size=run.world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
        pp=pp, pp_virtual_stages=cfg.pp_virtual_stages, zero_stage=cfg.zero_stage,
        sequence_parallel=cfg.sequence_parallel, pp_schedule=cfg.pp_schedule,
        pp_microbatches=cfg.pp_microbatches, pp_layer_split=tuple(cfg.pp_layer_split),
        data_parallel=DataParallelKind.of(dp_replicate=dp_replicate, fsdp_size=dp_shard * cp,
                                          zero_stage=cfg.zero_stage),
        local_batch=local, micro_batch_size=micro_batch_size,
        microbatches=int(pipeline_microbatches(cfg.pp_microbatches, pp, local,
                                               micro_batch_size)),
        kv_split=None if model is None else int(kv_split(model.num_kv_heads, tp)),
        run=run)


_SAFE_ON_PART_OF_DP = ("batch_splits",)
"""Rules that may be checked on a known part of the data-parallel degree (``dp_shard=-1``
with no world size yet): a batch that does not split over part of dp does not split over all."""


def check_layout(parallel: Any, model: Any, *, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, world_size: int | None, compile: bool = False,
                 document_masking: bool = False, batch_ramp: bool = False,
                 float8: bool = False, bf16_params: bool = False) -> list[str]:
    """Why ``parallel`` (a ``ParallelConfig``) cannot train ``model`` (a ``ModelConfig``) on
    this run; an empty list when the trainer runs it. One sentence per violated rule: the
    `layout_reasons` of its `resolve_layout`.

    ``world_size`` None (a config inspected away from its cluster): with ``dp_shard=-1`` the
    rules that depend on the data-parallel degree are skipped, except those a known part of
    it already decides; with a fixed ``dp_shard`` the world is the product of the degrees.
    ``micro_batch_size`` 0 (derived later) skips the rules that read it.
    """
    unresolved = world_size is None and parallel.dp_shard == -1
    if world_size is None:
        world_size = (parallel.dp_replicate * max(parallel.dp_shard, 1) * parallel.cp
                      * parallel.tp * parallel.pp)
    try:
        layout = resolve_layout(parallel, model, world_size=world_size, seq_len=seq_len,
                                global_batch_size=global_batch_size,
                                micro_batch_size=micro_batch_size, compile=compile,
                                document_masking=document_masking, batch_ramp=batch_ramp,
                                float8=float8, bf16_params=bf16_params)
    except UserError as err:  # the degrees do not fit the world
        return [str(err)]
    return _reasons(layout, model, unresolved=unresolved)


def layout_reasons(layout: ResolvedLayout, model: Any) -> list[str]:
    """Why the trainer cannot run ``layout`` with ``model``: every rule on the resolved layout
    and its run, then the explicit layer split (empty: it runs). A ``micro_batch_size`` of 0
    skips the rules that read it."""
    return _reasons(layout, model, unresolved=False)


def _reasons(layout: ResolvedLayout, model: Any, *, unresolved: bool) -> list[str]:
    run = layout.run
    skip = ({"dp", "dp_shard"} if unresolved else set()) | (
        {"micro_batch_size"} if layout.micro_batch_size <= 0 else set())
    reasons = [rule.reason(layout, model, run) for rule in RULES
               if _applies(rule, model, run, skip, unresolved)
               and rule.violated(layout, model, run)]
    return reasons + layer_split_reasons(list(layout.pp_layer_split), layout.num_stages,
                                         model.num_layers)


def _applies(rule: Rule, model: Any, run: RunShape, skip: set[str], unresolved: bool) -> bool:
    if not skip:
        return True
    if unresolved and rule.name in _SAFE_ON_PART_OF_DP and "micro_batch_size" not in skip:
        return True
    return not (fields_read(rule, model, run) & skip)


def require(names: tuple[str, ...], fields: Any, model: Any = None,
            run: RunShape | None = None) -> None:
    """Raise ``UserError`` with the reason of the first rule in ``names`` that ``fields`` (a
    `ResolvedLayout`, whose own ``run`` serves when ``run`` is None) breaks: the runtime guard
    of a builder called directly, outside a run whose layout `layout_reasons` checked, stated
    by the same rules as `check_layout`."""
    reasons = rule_reasons(names, fields, model, run)
    if reasons:
        raise UserError(reasons[0])


def rule_reasons(names: tuple[str, ...], fields: Any, model: Any = None,
                 run: RunShape | None = None) -> list[str]:
    """The reasons of the rules in ``names`` (in that order) that ``fields`` breaks."""
    if run is None:
        run = getattr(fields, "run", None)
    by_name = {rule.name: rule for rule in RULES}
    return [by_name[name].reason(fields, model, run) for name in names
            if by_name[name].violated(fields, model, run)]


def runnable_mask(columns: Mapping[str, Any], model: Any, run: RunShape) -> Any:
    """Boolean numpy array: which rows of ``columns`` (numpy arrays named as in
    ``ParallelConfig``, ``dp_shard`` resolved, plus ``micro_batch_size``; ``pp_schedule`` as
    strings) pass every rule. ``pp_layer_split`` is taken as balanced (empty)."""
    import numpy as np

    fields = SimpleNamespace(**{k: np.asarray(v) for k, v in columns.items()})
    fields.dp = fields.dp_replicate * fields.dp_shard
    ok = np.ones(len(fields.tp), dtype=bool)
    for rule in RULES:
        ok &= ~np.broadcast_to(np.asarray(rule.violated(fields, model, run), dtype=bool),
                               ok.shape)
    return ok
