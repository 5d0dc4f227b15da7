"""Resume safely: pick the newest checkpoint that verifies, and refuse a changed model or data.

`select_resume_checkpoint` walks the ``step-N`` directories newest first; one whose files do
not match its manifest is reported (which file, what is wrong), renamed to ``step-N.damaged``
(never deleted) and skipped, so a restart after damage continues from the previous good one by
itself. When checkpoints existed but none verifies (all damaged now, or set aside by an earlier
attempt) the resume is refused (`NoVerifiedCheckpointError`) rather than starting over from step
0 and throwing the run's progress away: every automatic restart gets the same refusal until
someone restores a checkpoint or starts over on purpose (``checkpoint.resume=false``).
`check_resume_config` compares the checkpoint's saved ``config.toml`` with the run's:
a change to a field that alters the model or the order of the training data is refused naming
each field with its old and new value, unless ``checkpoint.allow_config_change`` is set; then the
change is appended to the run's history file (``run_history.jsonl``). Steps, intervals, logging,
optimizer settings and the parallel layout may change freely (DCP reshards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import tomllib

from densetrain.checkpoint import collective, objstore
from densetrain.checkpoint.manager import (
    CONFIG_FILE,
    CheckpointError,
    checkpoint_dirs,
    set_aside,
    verify_checkpoint,
)
from densetrain.errors import DamagedFileError, UserError

HISTORY_FILE = "run_history.jsonl"
DAMAGED = "damaged"
"""The suffix of a checkpoint set aside on resume: ``step-N.damaged`` (``.damaged-2``, ...)."""
_DAMAGED_RE = re.compile(rf"^step-\d{{8,}}\.{DAMAGED}(-\d+)?$")

DATA_ORDER_FIELDS = frozenset({
    "data.datasets", "data.weights", "data.seq_len", "data.seed", "data.document_masking",
    "data.tokenizer", "data.default_vocab_size", "data.default_max_files",
    "data.default_val_fraction", "training.global_batch_size", "training.global_batch_tokens",
    "training.seed", "schedule.batch_ramp_start", "schedule.batch_ramp_tokens",
    "schedule.batch_ramp_increment",
})
"""Fields outside ``[model]`` that change which tokens a step sees (or the run's seed)."""

MODEL_FIELDS_FREE_ON_RESUME = frozenset({
    "model.init_std", "model.scale_residual_init", "model.dropout", "model.z_loss_coef",
})
"""Model fields that only act at initialisation or as training regularisers."""


class NoVerifiedCheckpointError(CheckpointError, DamagedFileError):
    """The run has checkpoints, but every one is damaged: resuming would start over from step 0
    (an input error to the CLI: exit 2, naming each one)."""


class ConfigChangeError(UserError):
    """The run's config changes the model or the data order of the checkpoint it resumes."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class FieldChange:
    """One guarded config field whose value differs between the checkpoint and the run."""

    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}"


def append_history(run_dir: str | os.PathLike, event: dict[str, Any]) -> None:
    """Append one JSON line (with a UTC time) to ``<run_dir>/run_history.jsonl`` (rank 0 only)."""
    if collective.rank() != 0:
        return
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **event})
    path = Path(run_dir) / HISTORY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # One short line in a single O_APPEND write: a reader sees the whole line or none of it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


def damaged_checkpoints(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints set aside as damaged under ``checkpoint_dir`` (``step-N.damaged``), by
    name."""
    if objstore.is_remote(checkpoint_dir):
        return []  # nothing is renamed on an object store (objstore.py)
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _DAMAGED_RE.match(p.name) and p.is_dir())


def select_resume_checkpoint(checkpoint_dir: str | os.PathLike, *,
                             run_dir: str | os.PathLike | None = None,
                             group: Any = None) -> Path | None:
    """The newest checkpoint under ``checkpoint_dir`` whose manifest verifies, or None when the
    run has none (a new run, or one stopped before its first save completed).

    Collective over ``group`` (every rank gets the same answer). Each damaged checkpoint is
    reported on stderr, renamed to ``<name>.damaged`` by rank 0 and noted in the run history.
    When none verifies but there were some (damaged now, or set aside before),
    `NoVerifiedCheckpointError` names each: the run is not silently started over. Under a URL
    (objstore.py) nothing can be renamed: a damaged or partial ``step-N`` prefix is named and
    skipped, and left in place.
    """
    remote = objstore.is_remote(checkpoint_dir)
    earlier = damaged_checkpoints(checkpoint_dir)  # every rank, before rank 0 renames any
    candidates = list(reversed(checkpoint_dirs(checkpoint_dir)))
    moved_now: list[str] = []
    for index, (step, path) in enumerate(candidates):
        damage = verify_checkpoint(path, group)
        if not damage:
            return path
        if remote:
            objstore.report_skipped(str(path), damage, index + 1 < len(candidates))
            moved_now.append("")
            if run_dir is not None:
                append_history(run_dir, {"event": "checkpoint_skipped", "step": step,
                                         "checkpoint": str(path),
                                         "damage": [str(d) for d in damage]})
        elif collective.rank() == 0:
            moved = set_aside(path, DAMAGED)
            moved_now.append(moved.name)
            details = "; ".join(map(str, damage))
            after = ("trying the previous one" if index + 1 < len(candidates)
                     else "no older checkpoint is left")
            print(f"checkpoint {path} is damaged ({details}); set aside as {moved.name}, "
                  f"{after}", file=sys.stderr)
            if run_dir is not None:
                append_history(run_dir, {"event": "checkpoint_set_aside", "step": step,
                                         "checkpoint": str(path), "moved_to": str(moved),
                                         "damage": [str(d) for d in damage]})
        collective.barrier(group)
    if candidates or earlier:
        root = str(checkpoint_dir) if remote else Path(checkpoint_dir)
        raise NoVerifiedCheckpointError(_none_verifies(root, candidates,
                                                       moved_now, earlier))
    return None


def _none_verifies(root: Path | str, candidates: list[tuple[int, Path]], moved_now: list[str],
                   earlier: list[Path]) -> str:
    """The refusal of a resume whose every checkpoint is damaged: which, and what to do."""
    if candidates:
        names = ", ".join(f"{Path(path).name} (now {new})" if new else Path(path).name
                          for (_, path), new in zip(candidates, moved_now or [""] * len(candidates),
                                                    strict=True))
        what = f"every checkpoint in {root} is damaged: {names}"
        if earlier:
            what += f"; set aside before: {', '.join(p.name for p in earlier)}"
    else:
        what = (f"{root} holds no checkpoint that verifies: all were set aside as damaged "
                f"({', '.join(p.name for p in earlier)})")
    return (f"refusing to start this run over from step 0: {what}. Nothing was trained. "
            "To continue, restore a good copy of a checkpoint as "
            f"{root}/step-NNNNNNNN (the damaged ones are kept, the reasons are in "
            f"{HISTORY_FILE}); to start over on purpose, pass --checkpoint.resume=false")


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flat(item, f"{prefix}.{key}"))
        return flat
    return {prefix: list(value) if isinstance(value, tuple) else value}


def _resolved_fields(config_toml: str, vocab_size: int | None) -> dict[str, Any]:
    """Every field of a job config as ``section.field`` -> value, the model fully resolved
    (preset plus overrides, so that a preset change that alters nothing passes)."""
    from densetrain.config import job_config_from_dict

    job = job_config_from_dict(tomllib.loads(config_toml), source="config", validate=False)
    fields: dict[str, Any] = {}
    for name, section in job.sections().items():
        if name != "model":
            fields.update(_flat(dataclasses.asdict(section), name))
    try:
        model = dataclasses.asdict(job.build_model_config(vocab_size))
    except ValueError:
        model = dataclasses.asdict(job.model)  # unresolvable: compare the section as written
    model.pop("extra", None)
    fields.update(_flat(model, "model"))
    return fields


def _guarded(name: str) -> bool:
    if name.startswith("model."):
        return name not in MODEL_FIELDS_FREE_ON_RESUME
    return name in DATA_ORDER_FIELDS


def config_changes(saved_toml: str, current_toml: str,
                   vocab_size: int | None = None) -> list[FieldChange]:
    """The guarded fields (model, data order) whose values differ, sorted by name."""
    saved = _resolved_fields(saved_toml, vocab_size)
    current = _resolved_fields(current_toml, vocab_size)
    names = sorted(n for n in set(saved) | set(current) if _guarded(n))
    return [FieldChange(field=n, old=saved.get(n), new=current.get(n))
            for n in names if saved.get(n) != current.get(n)]


def check_resume_config(checkpoint: Path | str, current_toml: str, *, allow_change: bool,
                        run_dir: str | os.PathLike, vocab_size: int | None = None
                        ) -> list[FieldChange]:
    """Refuse to resume ``checkpoint`` when the run changes its model or data order.

    Raises `ConfigChangeError` naming every changed field with old and new value, unless
    ``allow_change``; then the changes are appended to the run history and returned.
    """
    if objstore.is_remote(checkpoint):
        saved_path: Any = objstore.join(str(checkpoint), CONFIG_FILE)
        saved = objstore.read_text(str(checkpoint), CONFIG_FILE)
    else:
        saved_path = Path(checkpoint) / CONFIG_FILE
        saved = saved_path.read_text(encoding="utf-8") if saved_path.is_file() else None
    if saved is None:
        return []
    try:
        changes = config_changes(saved, current_toml, vocab_size)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        if allow_change:
            return []
        raise ConfigChangeError(
            f"the config saved in {saved_path} cannot be compared with this run's ({err}); "
            "pass --checkpoint.allow_config_change=true to resume anyway"
        ) from None
    if not changes:
        return []
    listed = "; ".join(map(str, changes))
    if not allow_change:
        raise ConfigChangeError(
            f"refusing to resume {checkpoint}: this run changes the model or the data order "
            f"({listed}). Restore those values, start a new run in another directory (or with "
            "training.init_from for the weights only), or pass "
            "--checkpoint.allow_config_change=true if you mean it (the change is then logged "
            f"in {HISTORY_FILE})"
        )
    append_history(run_dir, {"event": "config_override", "checkpoint": str(checkpoint),
                             "changes": [{"field": c.field, "old": c.old, "new": c.new}
                                         for c in changes]})
    if collective.rank() == 0:
        print(f"resuming {checkpoint} with a changed config (checkpoint.allow_config_change): "
              f"{listed}", file=sys.stderr)
    return changes


def check_optimizer_layout(checkpoint: Path | str, layout: str) -> None:
    """Refuse ``checkpoint`` when its optimizer state was saved in another layout than
    ``layout`` (this run's optimizer's: ZeRO-1/2 states are a rank's chunks and are not
    resharded on load), read from the checkpoint's DCP metadata."""
    from densetrain.checkpoint.manager import checkpoint_keys
    from densetrain.optim.interface import layout_of_saved_keys

    stored = checkpoint_keys(checkpoint)
    saved = layout_of_saved_keys(k[len("optim."):] for k in stored if k.startswith("optim."))
    if saved != layout:
        raise UserError(
            f"checkpoint {checkpoint} holds optimizer states {saved}, but this run's optimizer "
            f"is {layout}: ZeRO-1/2 optimizer states are not resharded, so resume it with the "
            "same parallel.zero_stage and world size (or set checkpoint.resume=false and "
            "training.init_from to take the weights only)"
        )
