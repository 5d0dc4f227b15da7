"""`JobConfig`: every section of a training job, composed from the components' own configs.

Sections and their owners: ``model`` (``ModelSection``: a preset name plus optional overrides of
any ``ModelConfig`` field), ``data`` (``DataConfig``), ``optim`` (``OptimConfig``), ``schedule``
(``ScheduleConfig``), ``training``, ``parallel`` (``ParallelConfig``), ``checkpoint``, ``eval``,
``logging`` and ``faults`` (``FaultsConfig``). Each builder receives only its own section;
``JobConfig.validate`` adds the rules that span sections (batch divisibility, warmup
shorter than the run, ...).

Validation and resolution are separate: ``validate`` checks and modifies nothing;
``resolved(world_size, dp_size)`` returns a new job with the derived fields filled (the global
batch and warmup from their token forms, the micro-batch size that 0 stands for), which is the
job the trainer, the dry run and the planner run and the config a run saves for its resume.
``checked(world_size, dp_size)`` does both in one pass (what the loader and the trainer call).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from densetrain.config.sections import (
    CheckpointConfig,
    EvalConfig,
    FaultsConfig,
    LoggingConfig,
    TrainingConfig,
)
from densetrain.data.config import DataConfig
from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.optim.config import OptimConfig, ScheduleConfig
from densetrain.parallel.config import ParallelConfig


def _model_section_fields() -> list[tuple[str, typing.Any, typing.Any]]:
    # Every ModelConfig field becomes an Optional override defaulting to None ("keep the
    # preset's value"); generated so that the section can never drift from ModelConfig.
    hints = typing.get_type_hints(ModelConfig)
    fields = [("preset", str, field(default="tiny-llama"))]
    for model_field in dataclasses.fields(ModelConfig):
        annotation = hints[model_field.name]
        fields.append((model_field.name, annotation | None, field(default=None)))
    return fields


ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    _model_section_fields(),
    kw_only=True,
    namespace={"__module__": __name__},
)
ModelSection.__doc__ = """The ``[model]`` section: ``preset`` plus ``ModelConfig`` field overrides.

``preset`` names a ``densetrain.models.presets`` entry (``tiny-llama``, ``gpt2-124m``,
``llama3-8b``, ...); empty means "no preset": the overrides then must give every required
``ModelConfig`` field. Every other field is a ``ModelConfig`` field, ``None`` = keep the preset's.
"""


def _model_section_validate(self) -> None:
    """Raise ``ValueError`` naming ``model.preset`` when it is not a string."""
    if not isinstance(self.preset, str):
        raise UserError(f"model.preset must be a preset name string, got {self.preset!r}")


def _model_section_overrides(self) -> dict:
    """The ``ModelConfig`` fields this section sets (those that are not None)."""
    return {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(self)
        if f.name != "preset" and getattr(self, f.name) is not None
    }


ModelSection.validate = _model_section_validate
ModelSection.overrides = _model_section_overrides

_VOCAB_FROM_TOKENIZER_KEYS = ("vocab_from_tokenizer", "tiny")


def _in_model_section(build, overrides: dict) -> ModelConfig:
    """``build(**overrides)``, its ``ValueError`` prefixed with ``[model]``: ModelConfig names
    its own fields (``num_heads``), which a job's user sets as ``model.num_heads``."""
    try:
        return build(**overrides)
    except ValueError as error:
        raise UserError(f"[model] {error}") from error


@dataclass(kw_only=True)
class JobConfig:
    """One training job: a typed section per component (see the module docstring)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    # ------------------------------------------------------------------ model
    def build_model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """``get_preset(model.preset).replace(**overrides)`` with the tokenizer's vocab if needed.

        ``vocab_size`` (the tokenizer's) replaces the preset's placeholder when the preset's
        ``extra`` marks it ``vocab_from_tokenizer`` (or ``tiny``) and ``model.vocab_size`` is
        unset, and fills ``vocab_size`` when there is no preset. Raises ``ValueError`` when
        ``data.seq_len`` exceeds the model's ``max_seq_len``.
        """
        overrides = self.model.overrides()
        if self.model.preset:
            from densetrain.models.presets import get_preset

            base = get_preset(self.model.preset)
            from_tokenizer = any(base.extra.get(k) for k in _VOCAB_FROM_TOKENIZER_KEYS)
            if vocab_size is not None and from_tokenizer and "vocab_size" not in overrides:
                overrides["vocab_size"] = vocab_size
            model_cfg = _in_model_section(base.replace, overrides) if overrides else base
        else:
            if vocab_size is not None and "vocab_size" not in overrides:
                overrides["vocab_size"] = vocab_size
            missing = [n for n in ("vocab_size", "dim", "num_layers", "num_heads")
                       if n not in overrides]
            if missing:
                raise UserError(
                    f"model.preset is empty, so the [model] section must set {missing} "
                    "(or name a preset such as 'tiny-llama')"
                )
            model_cfg = _in_model_section(ModelConfig, overrides)
        if self.data.seq_len > model_cfg.max_seq_len:
            raise UserError(
                f"data.seq_len={self.data.seq_len} exceeds the model's max_seq_len="
                f"{model_cfg.max_seq_len}; lower data.seq_len or set model.max_seq_len"
            )
        return model_cfg

    # ------------------------------------------------------------------ derived values
    def resolve(self, dp_size: int = 1) -> JobConfig:
        """A new job with the token forms resolved (``self`` is not modified).

        ``training.global_batch_tokens > 0`` sets ``training.global_batch_size``;
        ``schedule.warmup_tokens > 0`` sets ``schedule.warmup_steps`` (through the batch-size
        ramp when there is one). A derived field that was set to a non-default value that
        disagrees raises ``ValueError``: set only one of the pair. `resolved` also fills the
        micro-batch size for a world size.
        """
        from densetrain.config.rules import resolve_derived

        return resolve_derived(self, dp_size)

    def resolved(self, world_size: int | None = 1, dp_size: int | None = None) -> JobConfig:
        """A new job with every derived field filled for ``world_size`` (and ``dp_size``), as
        `validate` checks them: `densetrain.config.rules.resolve_job`. ``self`` is not
        modified; call `validate` first (this checks only that the derivations can be made)."""
        from densetrain.config.rules import resolve_job

        return resolve_job(self, world_size=world_size, dp_size=dp_size)

    def derived_micro_batch_size(self, dp_size: int) -> int:
        """The micro-batch size that ``training.micro_batch_size = 0`` stands for on ``dp_size``
        data-parallel ranks: the rank's batch, split into the pipeline's microbatches under
        ``parallel.pp > 1``. Raises ``ValueError`` naming the fields when it does not divide.

        Deriving it keeps the documented quick commands valid on every layout (``dp_replicate=2``
        halves the rank's batch, ``pp=2`` needs at least two microbatches) without a per-layout
        setting; a fixed ``micro_batch_size`` is still the way to bound activation memory.
        """
        from densetrain.config.rules import derived_global_batch_size
        from densetrain.parallel.layout_check import pipeline_microbatches

        global_batch = derived_global_batch_size(self)
        local, remainder = divmod(global_batch, dp_size)
        if remainder or local == 0:
            raise UserError(
                f"training.global_batch_size={global_batch} is not divisible by the "
                f"data-parallel size {dp_size}; choose a multiple of {dp_size}"
            )
        par = self.parallel
        pieces = pipeline_microbatches(par.pp_microbatches, par.pp, local, 0)
        if local % pieces:
            raise UserError(
                f"the rank's batch of {local} sequences (training.global_batch_size="
                f"{global_batch} / data-parallel size {dp_size}) does not split into {pieces} "
                "pipeline microbatches; set training.micro_batch_size or "
                "parallel.pp_microbatches"
            )
        return local // pieces

    def validate(
        self, world_size: int | None = 1, dp_size: int | None = None, *, check_model: bool = True
    ) -> None:
        """Validate every section, then check the rules across sections on the derived values.

        Nothing is modified: the derived fields are resolved into a private copy to be checked
        (`densetrain.config.rules.validate_job`); a caller that needs them takes `resolved`
        with the same arguments.

        ``world_size`` None (inspecting a config away from its cluster) skips the rules that
        need the world size.

        ``dp_size`` is the data-parallel degree (dp_replicate × dp_shard) that divides the
        global batch; None derives it from ``parallel`` and ``world_size``. With
        ``check_model`` the model config is built (without the tokenizer's vocab) so that bad
        model overrides fail before any work.
        """
        from densetrain.config.rules import validate_job

        validate_job(self, world_size=world_size, dp_size=dp_size, check_model=check_model)

    def checked(self, world_size: int | None = 1, dp_size: int | None = None) -> JobConfig:
        """`validate` and `resolved` in one pass: the job validated for ``world_size`` (and
        ``dp_size``) and returned with its derived fields filled. ``self`` is not modified;
        the result equals ``self.resolved(world_size, dp_size)`` of a job that validates."""
        from densetrain.config.rules import validate_job

        return validate_job(self, world_size=world_size, dp_size=dp_size)

    def batch_size_schedule(self, dp_size: int = 1):
        """The ``BatchSizeSchedule`` of this job (constant unless ``schedule.batch_ramp_start``)."""
        from densetrain.config.rules import derived_global_batch_size
        from densetrain.optim.schedules import BatchSizeSchedule

        micro = self.training.micro_batch_size or self.derived_micro_batch_size(dp_size)
        increment = self.schedule.batch_ramp_increment or micro * dp_size
        return BatchSizeSchedule(
            global_batch_size=derived_global_batch_size(self),
            seq_len=self.data.seq_len,
            ramp_start=self.schedule.batch_ramp_start,
            ramp_tokens=self.schedule.batch_ramp_tokens,
            ramp_increment=increment,
        )

    def sections(self) -> dict[str, typing.Any]:
        """Section name → section dataclass, in file order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
