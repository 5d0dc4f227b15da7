"""What to change when a traced rank does not fit its device: the cheapest changes that would.

For a rank whose traced peak exceeds the budget (``--fit-gib``, 76 GiB by default: an 80 GB
H100 or A100 less the CUDA context, NCCL buffers and fragmentation a CPU trace cannot see),
each candidate change of the job's layout that still validates at the same world size is
priced by the planner at that rank's pipeline position: its predicted peak (scaled by the
rank's own traced/predicted ratio, so the planner's error on this job carries over) and its
step time on H100-80GB. The ones that fit are listed fastest first. Candidates, one change
each and the two memory switches together:

- more recompute: "none" -> "selective" (the norms and the MLP activation), "full" (the
  planner does not price ``parallel.ac_recompute``'s other parts);
- under a pipeline with FSDP, gradients reduce-scattered every microbatch
  (``parallel.pp_grad_reduce = "microbatch"``) instead of held unsharded over the step;
- half the micro-batch size;
- twice the pipeline stages, or twice the tensor-parallel degree, from the data-parallel ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from densetrain.config.job import JobConfig
from densetrain.errors import UserError

DEFAULT_BUDGET_GIB = 76.0
GIB = 2**30


@dataclass(frozen=True)
class Change:
    """One candidate change: the overrides that make it, the planner's peak at the rank
    (scaled by the rank's traced/predicted ratio) and its step time."""

    overrides: tuple[str, ...]
    peak_bytes: float
    step_s: float


def _with(job: JobConfig, parallel: dict | None = None, training: dict | None = None
          ) -> JobConfig:
    return dataclasses.replace(
        job, parallel=dataclasses.replace(job.parallel, **(parallel or {})),
        training=dataclasses.replace(job.training, **(training or {})))


def _candidates(job: JobConfig) -> list[tuple[tuple[str, ...], dict, dict]]:
    par, training = job.parallel, job.training
    out: list[tuple[tuple[str, ...], dict, dict]] = []
    mode = par.activation_checkpointing
    if mode == "none":
        out.append((("--parallel.activation_checkpointing=selective",),
                     {"activation_checkpointing": "selective", "ac_recompute": []}, {}))
    if mode in ("none", "selective"):
        out.append((("--parallel.activation_checkpointing=full",),
                    {"activation_checkpointing": "full"}, {}))
    reducible = (par.pp > 1 and par.zero_stage == 3 and par.pp_grad_reduce == "step"
                 and par.pp_schedule not in ("zero_bubble", "zbv"))
    if reducible:
        out.append((("--parallel.pp_grad_reduce=microbatch",),
                    {"pp_grad_reduce": "microbatch"}, {}))
        if mode == "none":
            out.append((("--parallel.pp_grad_reduce=microbatch",
                         "--parallel.activation_checkpointing=selective"),
                        {"pp_grad_reduce": "microbatch", "activation_checkpointing": "selective",
                         "ac_recompute": []}, {}))
    if training.micro_batch_size > 1:
        half = training.micro_batch_size // 2
        out.append(((f"--training.micro_batch_size={half}",), {}, {"micro_batch_size": half}))
    if par.dp_shard > 1 and par.dp_shard % 2 == 0:
        half = par.dp_shard // 2
        out.append(((f"--parallel.pp={2 * par.pp}", f"--parallel.dp_shard={half}"),
                    {"pp": 2 * par.pp, "dp_shard": half, "pp_microbatches": 0}, {}))
        out.append(((f"--parallel.tp={2 * par.tp}", f"--parallel.dp_shard={half}"),
                    {"tp": 2 * par.tp, "dp_shard": half}, {}))
    return out


def fitting_changes(job: JobConfig, world_size: int, report, *,
                    budget_bytes: float = DEFAULT_BUDGET_GIB * GIB) -> list[Change]:
    """The candidate changes (module docstring) under which ``report``'s rank would fit in
    ``budget_bytes``, fastest step first. ``job`` is the checked job the report traced."""
    from densetrain.dryrun.predict import _evaluate, planner_memory

    pp_rank = report.coordinates.get("pp", 0) if job.parallel.pp > 1 else None
    current = planner_memory(job, world_size, pp_rank)["total"]
    ratio = report.peak_bytes / current if current else 1.0
    found = []
    for overrides, parallel, training in _candidates(job):
        try:
            changed = _with(job, parallel, training).checked(world_size=world_size)
        except (UserError, ValueError):
            continue  # the change breaks a layout rule at this world size
        rank_pp = min(pp_rank or 0, changed.parallel.pp - 1) if changed.parallel.pp > 1 \
            else None
        peak = planner_memory(changed, world_size, rank_pp)["total"] * ratio
        if peak <= budget_bytes:
            found.append(Change(overrides, peak, float(_evaluate(changed, world_size)["step_s"])))
    return sorted(found, key=lambda c: c.step_s)


def format_advice(job: JobConfig, world_size: int, reports, *,
                  budget_bytes: float = DEFAULT_BUDGET_GIB * GIB) -> list[str]:
    """Report lines for each rank over ``budget_bytes``: its peak by kind and the changes that
    would fit (nothing for ranks that fit)."""
    from densetrain.dryrun.predict import _evaluate

    lines = []
    current_step = None
    for report in reports:
        if report.peak_bytes <= budget_bytes:
            continue
        if current_step is None:
            current_step = float(_evaluate(job, world_size)["step_s"])
        lines.append(f"rank {report.rank} does not fit: {report.peak_bytes / GIB:.2f} GiB traced, "
                     f"over {budget_bytes / GIB:.0f} GiB (see 'at the peak' above)")
        changes = fitting_changes(job, world_size, report, budget_bytes=budget_bytes)
        if not changes:
            lines.append("  no single change tried fits (more recompute, pp_grad_reduce, a "
                         "smaller micro-batch, twice the pp or tp degree): add devices")
            continue
        lines.append(f"  changes that fit, fastest first (planner at this rank, scaled by its "
                     f"traced/predicted ratio; step time on H100-80GB, now {current_step:.2f} s):")
        for change in changes:
            lines.append(f"    {' '.join(change.overrides)}   peak {change.peak_bytes / GIB:.1f} "
                         f"GiB   step {change.step_s:.2f} s")
    return lines
