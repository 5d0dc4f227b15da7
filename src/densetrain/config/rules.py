"""Rules that span sections of a ``JobConfig``: derived values and cross-section validation.

Everything here runs before any work (no data, model or process group is touched), so that a
bad job fails in a second with a message naming the fields involved.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar

from densetrain.config.sections import TrainingConfig
from densetrain.data.config import DataConfig
from densetrain.errors import UserError
from densetrain.optim.config import ScheduleConfig
from densetrain.parallel.config import ParallelConfig


class JobSections(Protocol):
    """What the rules read of a job: its sections and the builders that combine them
    (`densetrain.config.job.JobConfig` is one). The rules take this view rather than the class,
    so that this module does not depend on the module that calls it."""

    model: Any
    data: DataConfig
    training: TrainingConfig
    schedule: ScheduleConfig
    parallel: ParallelConfig

    def sections(self) -> dict[str, Any]: ...

    def batch_size_schedule(self, dp_size: int = 1) -> Any: ...

    def build_model_config(self, vocab_size: int | None = None) -> Any: ...

    def derived_micro_batch_size(self, dp_size: int) -> int: ...


J = TypeVar("J", bound=JobSections)

# Stands in for the tokenizer's vocabulary when a model config is built only to validate it
# (it replaces only placeholder vocabularies: tiny presets, or no preset).
_VALIDATION_VOCAB = 256
_DEFAULT_GLOBAL_BATCH = next(
    f.default for f in dataclasses.fields(TrainingConfig) if f.name == "global_batch_size"
)


def data_parallel_size(job: JobSections, world_size: int | None) -> int:
    """dp_replicate × dp_shard of ``job.parallel`` on ``world_size`` ranks (dp_shard -1 = rest).

    With ``world_size`` None (a config inspected away from its cluster) a ``dp_shard`` of -1
    counts as 1, so the result is the part of the data-parallel size the config fixes.
    """
    from densetrain.parallel.layout_check import resolve_dp_shard

    par = job.parallel
    if world_size is None:
        return par.dp_replicate * max(par.dp_shard, 1)
    dp_shard, problem = resolve_dp_shard(par, world_size)
    if problem:
        raise UserError(problem)
    return par.dp_replicate * dp_shard


def resolve_job(job: J, *, world_size: int | None = 1, dp_size: int | None = None) -> J:
    """A new job with the derived fields filled; ``job`` itself is never modified.

    - ``training.global_batch_size`` from ``training.global_batch_tokens / data.seq_len``
      (``global_batch_tokens`` stays: the batch follows ``data.seq_len``);
    - ``training.micro_batch_size`` when it is 0 ("derive", `JobConfig.derived_micro_batch_size`),
      once the data-parallel size is known: ``world_size`` and ``dp_size`` both None (a config
      inspected away from its cluster, where ``dp_shard = -1`` is not final) keep the 0, and the
      trainer derives it with its own world size;
    - ``schedule.warmup_steps`` from ``schedule.warmup_tokens``, which becomes 0: the conversion
      depends on the batch-size ramp and is then fixed for the run (a resumed run keeps its
      schedule, read from the resolved config it saved).

    ``dp_size`` None derives it from ``job.parallel`` and ``world_size``
    (`data_parallel_size`). The two sections that resolution fills (``training``,
    ``schedule``) are new objects in the result (``dataclasses.replace``); the others are shared
    with ``job``. A derivation that cannot be made raises the ``UserError`` that
    `validate_job` raises for it; nothing else is checked (validate first).
    """
    resolved = _own_derived_sections(job)
    known_dp = dp_size or data_parallel_size(job, world_size)
    if resolved.training.micro_batch_size == 0 and not (world_size is None and dp_size is None):
        resolved.training.micro_batch_size = resolved.derived_micro_batch_size(known_dp)
    _resolve_global_batch(resolved)
    _resolve_warmup(resolved, known_dp)
    return resolved


def resolve_derived(job: J, dp_size: int = 1) -> J:
    """A new job with ``training.global_batch_size`` and ``schedule.warmup_steps`` filled from
    their token forms on ``dp_size`` data-parallel ranks (`resolve_job` without the micro-batch
    size); ``job`` itself is never modified."""
    resolved = _own_derived_sections(job)
    _resolve_global_batch(resolved)
    _resolve_warmup(resolved, dp_size)
    return resolved


def _own_derived_sections(job: J) -> J:
    """A shallow copy of ``job`` with copies of the sections that resolution writes, so that
    the ``_resolve_*`` steps below, which fill them in place, never reach the caller's job."""
    return dataclasses.replace(job, training=dataclasses.replace(job.training),
                               schedule=dataclasses.replace(job.schedule))


def derived_global_batch_size(job: JobSections) -> int:
    """``training.global_batch_size`` as resolved: ``global_batch_tokens / data.seq_len`` when
    ``global_batch_tokens > 0`` (a disagreeing explicit batch size, or tokens that are not a
    multiple of ``data.seq_len``, raise ``UserError``), else the field itself."""
    training = job.training
    if training.global_batch_tokens <= 0:
        return training.global_batch_size
    seq_len = job.data.seq_len
    if training.global_batch_tokens % seq_len:
        raise UserError(
            f"training.global_batch_tokens={training.global_batch_tokens} is not divisible "
            f"by data.seq_len={seq_len}; choose a multiple of {seq_len}"
        )
    derived = training.global_batch_tokens // seq_len
    if training.global_batch_size not in (_DEFAULT_GLOBAL_BATCH, derived):
        raise UserError(
            f"training.global_batch_size={training.global_batch_size} disagrees with "
            f"training.global_batch_tokens={training.global_batch_tokens} / data.seq_len="
            f"{seq_len} = {derived}; set only one of them"
        )
    return derived


# The two steps below fill a job in place: only ever a copy made by `_own_derived_sections`.
def _resolve_global_batch(job: JobSections) -> None:
    job.training.global_batch_size = derived_global_batch_size(job)


def _resolve_warmup(job: JobSections, dp_size: int) -> None:
    schedule = job.schedule
    if schedule.warmup_tokens <= 0:
        return
    if schedule.warmup_steps > 0:
        raise UserError(
            f"schedule.warmup_steps={schedule.warmup_steps} and schedule.warmup_tokens="
            f"{schedule.warmup_tokens} are both set; set only one of them"
        )
    batch_schedule = job.batch_size_schedule(dp_size)
    schedule.warmup_steps = max(1, batch_schedule.steps_for_tokens(schedule.warmup_tokens))
    schedule.warmup_tokens = 0


def validate_job(
    job: JobSections,
    *,
    world_size: int | None = 1,
    dp_size: int | None = None,
    check_model: bool = True,
) -> J:
    """Validate each section, then check the rules across sections on the resolved values;
    return the resolved job (what `resolve_job` returns for the same arguments).

    ``job`` is not modified: the derived values (`resolve_job`) are resolved into a private copy,
    step by step where the checks need them, which keeps the order in which a job with several
    problems is told them; that copy, checked, is the result, so that a caller validates and
    resolves in one pass (`JobConfig.checked`).

    ``world_size`` None skips the checks that need it (degrees multiplying to the world size)
    and checks batch divisibility against the data-parallel size the config fixes.
    """
    job = _own_derived_sections(job)
    away = world_size is None and dp_size is None
    derive_micro = job.training.micro_batch_size == 0
    if derive_micro:
        # The derived micro-batch size is checked like a stated one (layout, ramp); away from
        # the cluster (world_size and dp_size None) against the data-parallel size the config
        # fixes, as the trainer derives it again with its own.
        job.training.validate()
        known_dp = dp_size or data_parallel_size(job, world_size)
        dp_size = known_dp if dp_size is None else dp_size
        job.training.micro_batch_size = job.derived_micro_batch_size(known_dp)
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise UserError(f"world size must be a positive integer, got {world_size!r}")
    for name, section in job.sections().items():
        validate = getattr(section, "validate", None)
        if validate is None:
            raise TypeError(f"section [{name}] ({type(section).__name__}) has no validate()")
        # [parallel] too: `ParallelConfig.__post_init__` checks a section when it is built, and
        # this is THE check of the section a job carries (fields may be set after it was
        # built); `ParallelDims.from_config` relies on one of the two and checks nothing again.
        validate()
    if dp_size is None:
        dp_size = data_parallel_size(job, world_size)
    if not isinstance(dp_size, int) or dp_size < 1 or (world_size or dp_size) % dp_size:
        raise UserError(
            f"data-parallel size must be a positive divisor of the world size {world_size}, "
            f"got {dp_size!r}"
        )
    _resolve_global_batch(job)
    if check_model and (job.model.preset or job.model.overrides()):
        _check_layout(job, job.build_model_config(vocab_size=_VALIDATION_VOCAB), world_size)
    _check_batch(job, dp_size)
    _resolve_warmup(job, dp_size)
    _check_schedule_fits_run(job)
    if derive_micro and away:
        # Checked against the config's own data-parallel size, but not final away from the
        # cluster: the result keeps "derive" (0), as `resolve_job` does.
        job.training.micro_batch_size = 0
    return job


def _check_layout(job: JobSections, model_cfg: Any, world_size: int | None) -> None:
    """The trainer's layout rules (``parallel.layout_check.check_layout``, the same function
    the trainer and the planner use) for this job's parallel section, model and batch."""
    from densetrain.parallel.config import computes_in_bf16_params
    from densetrain.parallel.layout_check import check_layout

    reasons = check_layout(job.parallel, model_cfg, seq_len=job.data.seq_len,
                           global_batch_size=job.training.global_batch_size,
                           micro_batch_size=job.training.micro_batch_size,
                           world_size=world_size, compile=job.training.compile,
                           document_masking=job.data.document_masking,
                           batch_ramp=job.schedule.batch_ramp_start > 0,
                           float8=job.training.dtype == "float8",
                           bf16_params=computes_in_bf16_params(job.parallel, job.training.dtype))
    if reasons:
        raise UserError(reasons[0])


def _check_batch(job: JobSections, dp_size: int) -> None:
    training, schedule = job.training, job.schedule
    # global_batch_size splitting into micro x dp is the layout rule "batch_splits"
    unit = training.micro_batch_size * dp_size
    start = schedule.batch_ramp_start
    if start <= 0:
        return
    increment = schedule.batch_ramp_increment or unit
    if increment % unit:
        raise UserError(
            f"schedule.batch_ramp_increment={increment} must be a multiple of "
            f"training.micro_batch_size × data-parallel size = {unit}"
        )
    if start % unit or start >= training.global_batch_size:
        raise UserError(
            f"schedule.batch_ramp_start={start} must be a multiple of micro_batch_size × "
            f"data-parallel size = {unit} and below training.global_batch_size="
            f"{training.global_batch_size}"
        )
    if (training.global_batch_size - start) % increment:
        raise UserError(
            f"training.global_batch_size - schedule.batch_ramp_start = "
            f"{training.global_batch_size - start} is not divisible by the ramp increment "
            f"{increment} (schedule.batch_ramp_increment, 0 = micro × dp)"
        )


def _check_schedule_fits_run(job: JobSections) -> None:
    schedule, steps = job.schedule, job.training.steps
    if schedule.warmup_steps >= steps:
        raise UserError(
            f"schedule.warmup_steps={schedule.warmup_steps} must be shorter than the run "
            f"(training.steps={steps}); e.g. --schedule.warmup_steps={steps // 10}"
        )
    if schedule.name == "wsd":
        from densetrain.optim.schedules import wsd_decay_steps

        decay_steps = wsd_decay_steps(schedule, steps)
        if schedule.warmup_steps + decay_steps > steps:
            raise UserError(
                f"schedule.warmup_steps={schedule.warmup_steps} + wsd decay steps {decay_steps} "
                f"(schedule.decay_fraction={schedule.decay_fraction} × {steps}) exceed "
                f"training.steps={steps}"
            )
