"""Where each metrics record goes besides ``metrics.jsonl``: TensorBoard and Weights & Biases
(optional extras), and the console (a progress bar on a terminal, else one plain line).

A sink takes the same record the JSONL writer appends (`MetricsWriter.write`), so every log
holds the same numbers. ``rewind(step)`` tells it that the steps after ``step`` are void (a
resume from an older checkpoint, a loss-spike rollback).
"""

from __future__ import annotations

import math
import os
import secrets
import string
import sys
from pathlib import Path
from typing import Any, Protocol

from densetrain.errors import UserError

TENSORBOARD_MISSING = (
    "note: tensorboard is not installed, so no TensorBoard events are written "
    "(pip install 'densetrain[tensorboard]', or --logging.tensorboard=false to silence this)"
)
WANDB_MISSING = (
    "logging.wandb=true needs the wandb package, which is not installed: "
    "pip install 'densetrain[wandb]' (or set --logging.wandb=false)"
)  # also checked by LoggingConfig.validate, before any work


class RecordSink(Protocol):
    """A destination of metrics records."""

    def write(self, record: dict[str, Any]) -> None:
        """Take one record (it holds ``step``)."""

    def rewind(self, step: int) -> None:
        """The steps after ``step`` are void; they will be logged again."""

    def close(self) -> None:
        """Flush and release."""


def numeric_items(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers (booleans, strings and ``step`` left out)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars to ``<run_dir>/tensorboard`` through ``torch.utils.tensorboard``.

    On a resume or rollback the event files are reopened with ``purge_step``, so TensorBoard
    hides the events of the void steps instead of drawing two curves.
    """

    def __init__(self, log_dir: Path, *, resume_step: int) -> None:
        self.log_dir = log_dir
        self._writer = self._open(resume_step)

    def _open(self, step: int):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.log_dir), purge_step=step + 1 if step else None)

    def write(self, record: dict[str, Any]) -> None:
        """Add each number of the record as a scalar at the record's step."""
        for key, value in numeric_items(record).items():
            self._writer.add_scalar(key, value, global_step=record["step"])
        self._writer.flush()

    def rewind(self, step: int) -> None:
        """Reopen, purging the events after ``step``."""
        self._writer.close()
        self._writer = self._open(step)

    def close(self) -> None:
        """Close the event file."""
        self._writer.close()


def open_tensorboard(run_dir: Path, *, resume_step: int) -> TensorBoardSink | None:
    """A `TensorBoardSink`, or None when the tensorboard package is not installed."""
    try:
        import torch.utils.tensorboard  # noqa: F401 - raises ImportError without tensorboard
    except ImportError:
        return None
    return TensorBoardSink(run_dir / "tensorboard", resume_step=resume_step)


class WandbSink:
    """The records to a Weights & Biases run, with the job's resolved config as its config.

    Every number of a record is logged with ``step`` as its x-axis (``define_metric``), so a
    re-logged step after a rollback keeps its step number. The W&B run id is kept in
    ``<run_dir>/wandb_run_id``: a resumed training run continues the same W&B run.
    """

    def __init__(self, *, run_dir: Path, project: str, name: str, directory: str, mode: str,
                 config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise UserError(WANDB_MISSING) from err
        log_dir = Path(directory) if directory else run_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, name=name or run_dir.resolve().name, dir=str(log_dir),
            mode=mode or None, config=config, id=_wandb_run_id(run_dir),
            resume="allow",
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict[str, Any]) -> None:
        """Log the record's numbers with its step."""
        self.run.log({"step": record["step"], **numeric_items(record)})

    def rewind(self, step: int) -> None:
        """Nothing to undo: the re-logged steps carry their step numbers."""

    def close(self) -> None:
        """Finish the W&B run (offline: its files are complete for ``wandb sync``)."""
        self.run.finish()


def _wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id, made once (8 characters of [a-z0-9], as W&B's own ids)."""
    path = run_dir / "wandb_run_id"
    if path.is_file():
        return path.read_text(encoding="ascii").strip()
    alphabet = string.ascii_lowercase + string.digits
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n", encoding="ascii")
    os.replace(tmp, path)
    return run_id


def terminal_output() -> bool:
    """True when stdout and stderr are both terminals (a progress bar can redraw in place)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def format_duration(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``42s`` (``?`` when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_log_line(record: dict[str, Any], *, total_steps: int, val_loss: float,
                    eta_s: float) -> str:
    """One plain line for a metrics record: step, loss, val loss (the latest, when there is
    one), lr, tokens/s, MFU, gradient norm, ETA."""
    fields = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}"]
    if math.isfinite(val_loss):
        fields.append(f"val {val_loss:.4f}")
    mfu = record["mfu"]
    fields += [
        f"lr {record['lr']:.2e}",
        f"{record['tokens_per_s']:,.0f} tok/s",
        f"mfu {100 * mfu:.1f}%" if math.isfinite(mfu) else "mfu n/a",
        f"grad {record['grad_norm']:.3g}",
        f"eta {format_duration(eta_s)}",
    ]
    return " | ".join(fields)
