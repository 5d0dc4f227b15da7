"""Load, override, print and save ``JobConfig``s as TOML.

- ``load_job_config(path, overrides)``: the embedded default job (``default_job_config()``) when
  ``path`` is None, else a TOML file whose tables are sections (``[optim]``, ...) over the
  dataclass defaults; then ``--section.field=value`` overrides; then ``validate()``, and the
  resolved copy (derived fields filled) is returned.
- Unknown sections or fields raise ``ValueError`` naming the file or the override and the
  closest known names (``difflib``).
- ``job_config_to_toml`` writes the resolved config (it loads back to an equal ``JobConfig``);
  ``save_job_config`` writes it atomically (temporary name, then rename).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from densetrain.coerce import coerce, coerce_dataclass, unknown_key_message
from densetrain.config.job import JobConfig
from densetrain.config.sections import TrainingConfig
from densetrain.errors import UserError
from densetrain.optim.config import OptimConfig, ScheduleConfig

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


_DEFAULT_WARMUP_STEPS = 30
_DEFAULT_WARMUP_FRACTION = 0.1  # 30 of the default's 300 steps
_DEFAULT_LOSS_CHUNK = 1024
_WARMUP_KEYS = ("schedule.warmup_steps", "schedule.warmup_tokens")


def default_job_config() -> JobConfig:
    """The embedded default job: ``tiny-llama`` on the standard-library corpus, a few CPU minutes.

    ``configs/default.toml`` spells out the same values (a test keeps them equal).
    """
    return JobConfig(
        optim=OptimConfig(lr=3e-3),
        schedule=ScheduleConfig(name="cosine", warmup_steps=_DEFAULT_WARMUP_STEPS),
        # The chunked output head: never the full logits (what the planner assumes, and what
        # a job it emits, built from this default, runs); 1.06x the full-logits step of this
        # model on 2 CPU cores, and chunks of 1,024 were the fastest of 256-2,048 for a 50k vocab
        # (benchmarks/bench_train.py, variants densetrain-fp32@N).
        training=TrainingConfig(loss_chunk_size=_DEFAULT_LOSS_CHUNK),
    )


def _scale_default_warmup(job: JobConfig, override_keys: set[str]) -> None:
    """Warmup of the embedded default for a run of another length, unless the user set one.

    The default warms up for 30 of its 300 steps. A quick experiment shortens the run
    (``--training.steps=20``); a fixed 30-step warmup would then be longer than the run, so the
    default's warmup follows the run: ``min(30, 10% of training.steps)`` (0 below 10 steps).
    A warmup the user states (``--schedule.warmup_steps`` or ``--schedule.warmup_tokens``, or
    any config file) is taken as written, and one longer than the run is an error naming the
    override that fixes it; only the default's own value is ever adjusted, never the user's.
    """
    if override_keys & set(_WARMUP_KEYS):
        if "schedule.warmup_steps" not in override_keys:
            job.schedule.warmup_steps = 0  # warmup_tokens replaces the default's warmup_steps
        return
    job.schedule.warmup_steps = min(
        _DEFAULT_WARMUP_STEPS, int(job.training.steps * _DEFAULT_WARMUP_FRACTION)
    )


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def job_config_from_dict(data: dict, *, source: str = "<dict>", validate: bool = True) -> JobConfig:
    """Build a ``JobConfig`` from ``{section: {field: value}}`` over the dataclass defaults.

    ``source`` names where the dict came from in error messages. With ``validate`` the job is
    validated without a world size (the trainer validates again with its own) and returned
    resolved (`JobConfig.resolved`).
    """
    job = JobConfig()
    _merge_into(job, data, source)
    if validate:
        return job.checked(world_size=None)
    return job


def _merge_into(job: JobConfig, data: dict, source: str) -> None:
    types_by_section = _section_types()
    for section_name, values in data.items():
        if section_name not in types_by_section:
            owners = _sections_with_field(section_name, types_by_section)
            moved = (f"; {section_name} is a field: put it under "
                     f"{' or '.join(f'[{o}]' for o in owners)}" if owners else "")
            raise UserError(
                unknown_key_message(section_name, section_name, list(types_by_section), source)
                + moved
            )
        if not isinstance(values, dict):
            raise UserError(f"{source}: [{section_name}] must be a table, got {values!r}")
        current = dataclasses.asdict(getattr(job, section_name))
        for key in values:
            if key not in current:
                owners = _sections_with_field(key, types_by_section, but=section_name)
                moved = (f"; {key} belongs in {' or '.join(f'[{o}]' for o in owners)}"
                         if owners else "")
                raise UserError(
                    unknown_key_message(f"{section_name}.{key}", key, list(current), source)
                    + moved
                )
        current.update(values)
        try:
            section = coerce_dataclass(current, types_by_section[section_name], section_name)
        except ValueError as error:
            raise UserError(f"{source}: {error}") from None
        setattr(job, section_name, section)


def load_job_config(
    path: str | os.PathLike | None,
    overrides: list[str] | None = None,
    *,
    world_size: int | None = None,
) -> JobConfig:
    """Load ``path`` (None = the embedded default), apply ``overrides``, validate, return the
    job resolved for ``world_size`` (`JobConfig.resolved`).

    On the embedded default, a warmup the overrides leave unset follows ``training.steps``
    (``_scale_default_warmup``).

    ``world_size`` None validates what does not depend on the world size (the trainer calls
    ``job.validate(world_size=...)`` again once it knows it).

    Overrides are ``--section.field=value`` (or ``--section.field value``; a bare
    ``--section.flag`` sets a boolean to true). Nested fields use more dots:
    ``--model.rope_scaling.factor=8``.
    """
    if path is None:
        job, source = default_job_config(), "the embedded default config"
    else:
        source = str(path)
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError:
            raise UserError(f"config file {source!r} does not exist") from None
        except IsADirectoryError:
            raise UserError(f"config file {source!r} is a directory; give a TOML file (e.g. "
                            "one written by `densetrain plan --emit-config`)") from None
        except UnicodeDecodeError as error:
            raise UserError(f"config file {source!r} is not valid TOML: not UTF-8 text "
                            f"({error})") from None
        except tomllib.TOMLDecodeError as error:
            raise UserError(f"config file {source!r} is not valid TOML: {error}") from None
        job = job_config_from_dict(data, source=f"config file {source!r}", validate=False)
    parsed = parse_overrides(overrides or [])
    for key, value, text in parsed:
        apply_override(job, key, value, text)
    if path is None:
        _scale_default_warmup(job, {key for key, _, _ in parsed})
    return job.checked(world_size=world_size)


def parse_overrides(arguments: list[str]) -> list[tuple[str, str | None, str]]:
    """Split command-line words into ``(dotted key, value or None, original text)``."""
    parsed, index = [], 0
    while index < len(arguments):
        word = arguments[index]
        if not word.startswith("--") or len(word) <= 2:
            raise UserError(
                f"override {word!r} must look like --section.field=value or --section.field "
                "value (e.g. --optim.lr=1e-3); a CONFIG file comes before the overrides"
            )
        body = word[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            parsed.append((key, value, word))
        elif index + 1 < len(arguments) and not arguments[index + 1].startswith("--"):
            index += 1
            parsed.append((body, arguments[index], f"{word} {arguments[index]}"))
        else:
            parsed.append((body, None, word))
        index += 1
    return parsed


def _sections_with_field(key: str, types_by_section: dict[str, type],
                         but: str | None = None) -> list[str]:
    """The sections (other than ``but``) that have a top-level field named ``key``."""
    return [name for name, section_type in types_by_section.items()
            if name != but and key in {f.name for f in dataclasses.fields(section_type)}]


def _shown_value(value: str | None) -> str:
    """``=value`` as a suggested override repeats it; "" for a bare ``--section.flag``."""
    return f"={value}" if value is not None else ""


def _bare_key_hint(key: str, value: str | None, types_by_section: dict[str, type]) -> str:
    """What a key without a section most likely meant: the sections that have a field of that
    name (``--steps=5``: ``--training.steps=5``), a CONFIG file given as ``--config FILE``, or
    the ``--set`` prefix of other tools."""
    shown = _shown_value(value)
    if key in ("config", "config-file", "config_file", "c"):
        return (f"; a config file is not an option: densetrain train {value or 'FILE.toml'} "
                "[--section.field=value ...]")
    if key in ("set", "override", "o"):
        return f"; overrides need no --{key}: write --{value or 'section.field=value'}"
    if key in types_by_section:
        fields = [f.name for f in dataclasses.fields(types_by_section[key])]
        return f"; [{key}] is a section: name one of its fields, --{key}.FIELD{shown} " \
            f"(fields: {', '.join(fields)})"
    owners = _sections_with_field(key, types_by_section)
    if owners:
        return "; did you mean " + " or ".join(f"--{name}.{key}{shown}" for name in owners) + "?"
    return f" (sections: {', '.join(types_by_section)})"


def apply_override(job: JobConfig, key: str, value: str | None, text: str | None = None) -> None:
    """Set ``section.field[.subfield]`` of ``job`` to ``value`` coerced to the field's type."""
    where = f"override {text or key!r}"
    parts = key.split(".")
    types_by_section = _section_types()
    if len(parts) < 2:
        raise UserError(
            f"{where}: the key must be section.field, got {key!r}"
            + _bare_key_hint(key, value, types_by_section)
        )
    if parts[0] not in types_by_section:
        raise UserError(unknown_key_message(parts[0], parts[0], list(types_by_section), where))
    section_name = parts[0]
    section_data = dataclasses.asdict(getattr(job, section_name))
    target = section_data
    for depth, part in enumerate(parts[1:-1], start=1):
        dotted = ".".join(parts[: depth + 1])
        if part not in target:
            raise UserError(unknown_key_message(dotted, part, list(target), where))
        if target[part] is None:
            target[part] = {}
        if not isinstance(target[part], dict):
            raise UserError(f"{where}: {dotted} is not a table, it has no field {parts[-1]!r}")
        target = target[part]
    last = parts[-1]
    is_top_field = len(parts) == 2
    if is_top_field and last not in target:
        owners = _sections_with_field(last, types_by_section, but=section_name)
        shown = _shown_value(value)
        moved = ("; it is a field of " + " or ".join(f"[{o}]: --{o}.{last}{shown}"
                                                     for o in owners)) if owners else ""
        raise UserError(unknown_key_message(key, last, list(target), where) + moved)
    if value is None:
        value = "true"  # a bare --section.flag
    if is_top_field:
        hints = typing.get_type_hints(types_by_section[section_name])
        try:
            target[last] = coerce(value, hints[last], key)
        except ValueError as error:
            raise UserError(f"{where}: {error}") from None
    else:
        target[last] = value  # nested: coerced with the enclosing dataclass below
    try:
        section = coerce_dataclass(section_data, types_by_section[section_name], section_name)
    except ValueError as error:
        raise UserError(f"{where}: {error}") from None
    setattr(job, section_name, section)


# ---------------------------------------------------------------------- TOML output
def job_config_to_toml(job: JobConfig) -> str:
    """The job as TOML text that ``load_job_config`` reads back into an equal ``JobConfig``.

    Fields whose value is None are written as comments (TOML has no null); in ``[model]`` only
    the overrides that are set appear.
    """
    lines = ["# densetrain job config (resolved)"]
    for section_name, section in job.sections().items():
        lines.append("")
        lines.append(f"[{section_name}]")
        for section_field in dataclasses.fields(section):
            value = getattr(section, section_field.name)
            if value is None:
                if section_name != "model":
                    lines.append(f"# {section_field.name} = (unset)")
                continue
            lines.append(f"{section_field.name} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    """One TOML value: bool, int, float, str, list, dict or dataclass (as an inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return text if any(c in text for c in ".eninf") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        items = [
            f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None
        ]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def _toml_key(key: Any) -> str:
    key = str(key)
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _unwritable(target: Path, error: OSError) -> Exception:
    """``error`` of writing ``target`` (or its temporary sibling), told of ``target``: a full or
    read-only disk keeps its errno (the CLI names those), anything else says why."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return OSError(error.errno, error.strerror, str(target))
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        why = f"{parent} is a file, not a directory"
    else:
        why = error.strerror or str(error)
    return UserError(f"{target} cannot be written: {why}")


def save_job_config(job: JobConfig, path: str | os.PathLike) -> Path:
    """Write ``job_config_to_toml(job)`` to ``path`` atomically (temporary file, then rename)."""
    target = Path(path)
    text = job_config_to_toml(job)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp",
            delete=False,
        )
    except OSError as error:  # named as the file asked for, not its temporary sibling
        raise _unwritable(target, error) from error
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, target)
    except OSError as error:
        Path(handle.name).unlink(missing_ok=True)
        raise _unwritable(target, error) from error
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return target
