"""Open a training checkpoint outside the trainer (eval, generate, export, ``training.init_from``).

`open_training_checkpoint(path)` takes one ``step-N`` checkpoint, a directory of them or a run
directory (``checkpoints/`` inside), and returns the newest checkpoint whose files match its
manifest (size and SHA-256 of every file, as a resume checks) with the job config stored in it,
checked against the manifest's record of it. Nothing is trusted before that:

- a ``step-N`` named directly must verify itself; damage is an error naming each file;
- in a directory of checkpoints a damaged newest one is named on stderr and the previous one is
  used; when none verifies the error lists each ``step-N`` and what is wrong with it.

Unlike a resume nothing is renamed: a reader does not own the run, and the run's next resume
sets the damaged ones aside itself.

``path`` may be an fsspec URL (``s3://bucket/run/checkpoints``, a run prefix holding
``checkpoints/``, or one ``step-N`` prefix): the same rules, through `checkpoint.objstore`
(a prefix without a manifest is a partial save, named as damaged and passed over).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import tomllib

from densetrain.checkpoint import collective, objstore
from densetrain.checkpoint.manager import (
    CONFIG_FILE,
    CheckpointDamagedError,
    checkpoint_dirs,
    checkpoint_step,
    verify_checkpoint,
)
from densetrain.checkpoint.manifest import MANIFEST_FILE, Damage, read_manifest, sha256_text
from densetrain.errors import DamagedFileError, UserError, describe_error


@dataclass(frozen=True, kw_only=True)
class TrainingCheckpoint:
    """A verified training checkpoint: its directory, step and the job config stored in it."""

    path: Path | str  # a URL string for a checkpoint on an object store
    step: int
    job: Any  # densetrain.config.JobConfig (imported lazily: config sits above checkpoint)
    config_toml: str

    @cached_property
    def metadata(self) -> Any:
        """DCP's ``state_dict_metadata`` of the checkpoint (read once, through the restricted
        unpickler): each entry's global shape and dtype."""
        from densetrain.checkpoint.safe_pickle import read_dcp_metadata

        return read_dcp_metadata(self.path).state_dict_metadata

    def model_config(self, tokenizer: Any, *, explicit: bool) -> Any:
        """The ``ModelConfig`` of this checkpoint for ``tokenizer``: one with more ids than the
        model's vocabulary is refused naming both, and an ``explicit`` (``--tokenizer``) one
        must give the vocabulary the model was trained with (its embedding's rows)."""
        config = self.job.build_model_config(tokenizer.vocab_size)
        meta = self.metadata.get("model.tok_embeddings.weight")
        rows = tuple(getattr(meta, "size", ()))[:1]
        given = "--tokenizer " if explicit else "the run's tokenizer "
        if explicit and rows and rows[0] != config.padded_vocab_size:
            raise UserError(
                f"{given}{tokenizer.path} has {tokenizer.vocab_size} ids, but checkpoint "
                f"{self.path} was trained with an embedding of {rows[0]} rows: it is not the "
                "run's tokenizer; leave --tokenizer out to use the one the run trained with"
            )
        if tokenizer.vocab_size > config.vocab_size:
            raise UserError(
                f"{given}{tokenizer.path} has {tokenizer.vocab_size} ids but the model of "
                f"{self.path} only {config.vocab_size} (model.vocab_size): not the model's "
                "tokenizer"
            )
        return config


def _location(path: str | os.PathLike) -> Path | str:
    """``path`` as the code below takes it: a URL string (no trailing slash) or a ``Path``."""
    if objstore.is_remote(path):
        return str(path).rstrip("/")
    return objstore.checkpoint_location(str(path))


def _name(path: Path | str) -> str:
    return objstore.basename(path) if isinstance(path, str) else path.name


def _child(path: Path | str, name: str) -> Path | str:
    return objstore.join(path, name) if isinstance(path, str) else path / name


def _parent(path: Path | str) -> Path | str:
    return path.rsplit("/", 1)[0] if isinstance(path, str) else path.parent


def _is_one_checkpoint(path: Path | str) -> bool:
    """A ``step-N`` directory, or any directory holding a checkpoint manifest (a checkpoint
    copied elsewhere under another name)."""
    if isinstance(path, str):
        return checkpoint_step(_name(path)) is not None or objstore.has_manifest(path)
    return path.is_dir() and (checkpoint_step(path) is not None
                              or (path / MANIFEST_FILE).is_file())


def _manifest(path: Path | str) -> dict[str, Any] | None:
    if isinstance(path, str):
        return objstore._read_manifest(path)[0]
    return read_manifest(path)[0]


def _step_of(path: Path | str) -> int:
    step = checkpoint_step(_name(path))
    if step is not None:
        return step
    manifest = _manifest(path)
    return int(manifest["step"]) if manifest else 0


def _candidates(path: Path | str) -> tuple[Path | str, list[tuple[int, Any]]]:
    """The directory holding ``step-N`` checkpoints at ``path`` (itself or its run's
    ``checkpoints/``) and those checkpoints, oldest first."""
    from densetrain.checkpoint.resume import damaged_checkpoints

    for directory in (path, _child(path, "checkpoints")):
        if isinstance(directory, str):
            if checkpoint_dirs(directory):
                return directory, checkpoint_dirs(directory)
        elif directory.is_dir() and (checkpoint_dirs(directory) or damaged_checkpoints(directory)):
            return directory, checkpoint_dirs(directory)
    return path, []


def _stored_config(checkpoint: Path | str) -> tuple[str, Any]:
    """The job config of a verified checkpoint: its ``config.toml`` must be the one the manifest
    recorded, valid TOML and a job config."""
    from densetrain.config import job_config_from_dict

    config_path = _child(checkpoint, CONFIG_FILE)
    try:
        text = (objstore.read_text(checkpoint, CONFIG_FILE) if isinstance(checkpoint, str)
                else config_path.read_text(encoding="utf-8") if config_path.is_file() else None)
    except UnicodeDecodeError as error:
        raise DamagedFileError(f"{config_path} is not UTF-8 text ({error})") from None
    if text is None:
        raise DamagedFileError(
            f"checkpoint {checkpoint} has no {CONFIG_FILE} (it was saved without its job "
            "config), so its model cannot be rebuilt; load it with the job config that saved it "
            "(`densetrain train` resumes it)"
        )
    manifest = _manifest(checkpoint)
    recorded = (manifest or {}).get("config_sha256")
    if recorded is not None and recorded != sha256_text(text):
        raise DamagedFileError(
            f"{config_path} is not the checkpoint's own: its SHA-256 differs from the "
            "config_sha256 its manifest.json recorded at save time"
        )
    try:
        raw = tomllib.loads(text)
        job = job_config_from_dict(raw, source=str(config_path), validate=False)
    except (tomllib.TOMLDecodeError, ValueError, TypeError) as error:
        raise DamagedFileError(
            f"{config_path} is not a densetrain job config ({describe_error(error)})"
        ) from None
    return text, job


def _check(checkpoint: Path | str, group: Any = None
           ) -> tuple[list[Damage], tuple[str, Any] | None]:
    """What is wrong with ``checkpoint`` as a reader takes it (its files against the manifest,
    then its stored config), and its ``(config text, job)`` when nothing is."""
    damage = verify_checkpoint(checkpoint, group)
    if damage:
        return damage, None
    try:
        return [], _stored_config(checkpoint)
    except DamagedFileError as error:
        return [Damage(file=CONFIG_FILE, problem=str(error))], None


def _report(message: str) -> None:
    if collective.rank() == 0:
        print(message, file=sys.stderr)


def open_training_checkpoint(path: str | os.PathLike, *, group: Any = None
                             ) -> TrainingCheckpoint | None:
    """The newest verified checkpoint at ``path`` (see the module docstring), or None when
    ``path`` holds no training checkpoint at all.

    Collective over ``group`` when a process group is up (the ranks share the hashing), and
    single-process otherwise. Raises `CheckpointDamagedError` for a damaged ``step-N`` named
    directly and `DamagedFileError` when a directory's checkpoints are all damaged.
    """
    from densetrain.checkpoint.resume import damaged_checkpoints

    path = _location(path)
    if _is_one_checkpoint(path):
        damage = verify_checkpoint(path, group)
        if damage:
            raise CheckpointDamagedError(path, damage, hint=(
                f"give the directory holding it ({_parent(path)}) to use the newest checkpoint "
                "there that verifies, or `densetrain checkpoints` to list them"))
        text, job = _stored_config(path)
        return TrainingCheckpoint(path=path, step=_step_of(path), job=job, config_toml=text)
    root, candidates = _candidates(path)
    rejected: list[str] = []
    for step, candidate in reversed(candidates):
        damage, stored = _check(candidate, group)
        if stored is not None:
            if rejected:
                _report(f"using {candidate}, the newest checkpoint in {root} that verifies "
                        f"(damaged: {'; '.join(rejected)})")
            return TrainingCheckpoint(path=candidate, step=step, job=stored[1],
                                      config_toml=stored[0])
        rejected.append(f"{_name(candidate)}: " + "; ".join(map(str, damage)))
        _report(f"checkpoint {candidate} is damaged ({'; '.join(map(str, damage))}); "
                "trying the previous one")
    earlier = [] if isinstance(root, str) else damaged_checkpoints(root)
    if not rejected and not earlier:
        return None
    what = [f"{name}" for name in rejected] + [
        f"{p.name}: set aside as damaged by an earlier resume" for p in earlier]
    raise DamagedFileError(
        f"no checkpoint in {root} verifies against its manifest: " + " | ".join(what)
        + ". Restore a good copy of one as step-NNNNNNNN, or name an exported model directory"
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointStatus:
    """One entry of a checkpoint directory, as `survey_checkpoints` found it."""

    name: str
    step: int | None
    state: str  # "verified", "damaged", "set aside" (an earlier resume's) or "incomplete" (.tmp)
    bytes: int
    damage: tuple[str, ...] = ()


def _size(directory: Path | str) -> int:
    if isinstance(directory, str):
        return sum(objstore._files(directory).values())
    total = 0
    for child in directory.iterdir():
        try:
            total += child.stat().st_size if child.is_file() else 0
        except OSError:
            pass
    return total


def survey_checkpoints(path: str | os.PathLike) -> tuple[Path | str, list[CheckpointStatus]]:
    """Every checkpoint at ``path`` (a run directory, a checkpoint directory or one checkpoint),
    newest first, each ``step-N`` verified against its manifest (every file hashed) and its
    stored config read as `open_training_checkpoint` reads it; the directory surveyed. Reads
    only: nothing is renamed or removed (single process)."""
    from densetrain.checkpoint.resume import damaged_checkpoints

    path = _location(path)
    extra: list[Path] = []
    if _is_one_checkpoint(path):
        roots, candidates = _parent(path), [(_step_of(path), path)]
    elif isinstance(path, str):  # nothing is renamed on a store: no .tmp, nothing set aside
        roots, candidates = _candidates(path)
    else:
        roots, candidates = _candidates(path)
        if not candidates and (roots / "checkpoints").is_dir():  # a run with only .tmp saves
            roots = roots / "checkpoints"
        extra = damaged_checkpoints(roots) + sorted(
            p for p in roots.glob("step-*.tmp") if p.is_dir()) if roots.is_dir() else []
    found = []
    for step, candidate in reversed(candidates):
        damage = [str(d) for d in _check(candidate)[0]]  # as a reader takes it
        state = "damaged" if damage else "verified"
        found.append(CheckpointStatus(name=_name(candidate), step=step, state=state,
                                      bytes=_size(candidate), damage=tuple(damage)))
    for other in sorted(extra, reverse=True):
        state = "incomplete" if other.name.endswith(".tmp") else "set aside"
        found.append(CheckpointStatus(name=other.name, step=None, state=state,
                                      bytes=_size(other)))
    return roots, found
