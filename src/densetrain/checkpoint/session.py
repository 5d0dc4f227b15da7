"""`CheckpointSession`: everything a training run does with its checkpoints, in one object.

A run builds one session from its Stateful parts (model, optimizer, schedules, data stream,
progress counters, fault record), its checkpoint directory (a local path or a ``scheme://`` URL,
objstore.py) and its save settings. The session owns

- the schema: which entries one checkpoint holds (`tree`), and the migrations that load a
  checkpoint written before an entry existed (no ``faults`` entry; a data state without
  ``content``), read from the checkpoint's DCP metadata;
- resume: the newest checkpoint that verifies (`select_resume_checkpoint` sets damaged ones
  aside), the config and optimizer-layout checks, the load, the after-load hook, and the note
  of a resume on another number of ranks (`resume`);
- saving, synchronous or in the background (`AsyncCheckpointer`: at most one save in flight,
  pruning to ``keep_last`` once a save is sealed), with one ``state_dict()`` of the tree and
  one finiteness check per save (`save`, `wait`, `settled`, `close`);
- rollback: the newest complete checkpoint of step <= N, the later ones deleted, loaded
  without the fault record (`rollback`, `newest_at_most`).

The session decides nothing about the run: when to save, what a failed save means
(``checkpoint.on_save_error``), when to roll back and how far, are the loop's (train/
callbacks.py, faults.py), which call the session. `load_model_weights` is the session-free
reader behind ``training.init_from`` of a training checkpoint.

Every method that touches checkpoints is collective when a process group is up (every rank
calls it, at the same point), and runs on one process without one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from densetrain.checkpoint import collective
from densetrain.checkpoint.manager import (
    checkpoint_keys,
    load_checkpoint,
    newest_at_most,
    remove_checkpoints_after,
)
from densetrain.checkpoint.state import ModelState, RNGState


class CheckpointSession:
    """The checkpoints of one run (see the module docstring).

    ``model``, ``optimizer``, ``lr_schedule``, ``batch_schedule``, ``data``, ``progress`` and
    ``faults`` are the Stateful entries of the tree (``model`` a `ModelState`; the generators'
    entry, `RNGState`, is made per tree: it learns on load which ranks wrote it).
    ``directory``: where the checkpoints are; ``run_dir``: where the run's history goes;
    ``config_toml``: the resolved job config stored in each checkpoint and compared on resume.
    ``keep_last`` > 0 prunes to that many complete checkpoints after each save; ``async_save``
    writes in the background; ``timeout_s`` bounds the background collectives. ``after_load``
    runs after every load into the tree (the optimizer's `after_weights_loaded`). ``device``:
    where the flag of `settled_everywhere` lives (the training group's device).
    """

    def __init__(self, *, model: Any, optimizer: Any, lr_schedule: Any, batch_schedule: Any,
                 data: Any, progress: Any, faults: Any, directory: str | os.PathLike,
                 run_dir: str | os.PathLike, config_toml: str | None, keep_last: int = 0,
                 async_save: bool = False, timeout_s: float = 600.0, is_main: bool = True,
                 after_load: Callable[[], None] | None = None, device: Any = "cpu") -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.batch_schedule = batch_schedule
        self.data = data
        self.progress = progress
        self.faults = faults
        self.directory = directory
        self.run_dir = Path(run_dir)
        self.config_toml = config_toml
        self.keep_last = keep_last
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.is_main = is_main
        self.after_load = after_load or (lambda: None)
        self.device = device
        self.resumed_from: Path | str | None = None
        """The verified checkpoint `resume` loaded (None: the run started fresh)."""
        self._writer: Any = None

    # -- the schema -------------------------------------------------------------------------

    def tree(self, *, as_in: str | os.PathLike | None = None) -> dict[str, Any]:
        """The Stateful tree one checkpoint covers; ``as_in`` a checkpoint to load: the tree
        as that checkpoint holds it (one saved before the fault record existed has no
        ``faults`` entry; one saved before the data's contents were recorded, no
        ``data.content``)."""
        tree = {
            "model": self.model,
            "optim": self.optimizer,
            "lr_schedule": self.lr_schedule,
            "batch_schedule": self.batch_schedule,
            "data": self.data,
            "rng": RNGState(),
            "trainer": self.progress,
            "faults": self.faults,
        }
        if as_in is not None:
            from densetrain.data.stream import CONTENT_KEY

            stored = checkpoint_keys(as_in)
            if not any(key.startswith("faults.") for key in stored):
                del tree["faults"]  # no faults were recorded then
            if f"data.{CONTENT_KEY}" not in stored:
                tree["data"] = _DataStateBeforeContent(self.data)
        return tree

    # -- resume -----------------------------------------------------------------------------

    def resume(self, *, allow_config_change: bool = False, vocab_size: int | None = None,
               world_size: int | None = None, optimizer_layout: str | None = None) -> str:
        """Load the newest checkpoint that verifies into the tree (if any); returns its path
        or "".

        Damaged newer checkpoints are reported and set aside (`select_resume_checkpoint`);
        the saved config is compared with the run's first (`check_resume_config`: a changed
        model or data order is refused unless ``allow_config_change``; ``vocab_size`` resolves
        the model of both; no ``config_toml``: not compared), then the optimizer's state
        layout (``optimizer_layout``, the optimizer's ``checkpoint_layout``; None: not
        checked). A resume on another number of ranks than ``world_size`` (default: the
        process group's) is printed and recorded in ``run_history.jsonl``.
        """
        from densetrain.checkpoint.resume import (
            check_optimizer_layout,
            check_resume_config,
            select_resume_checkpoint,
        )
        from densetrain.data.stream import DataStateMismatchError

        latest = select_resume_checkpoint(self.directory, run_dir=self.run_dir)
        if latest is None:
            return ""
        if self.config_toml is not None:
            check_resume_config(latest, self.config_toml, allow_change=allow_config_change,
                                run_dir=self.run_dir, vocab_size=vocab_size)
        if optimizer_layout is not None:
            check_optimizer_layout(latest, optimizer_layout)
        tree = self.tree(as_in=latest)
        try:
            load_checkpoint(latest, tree, verify=False)  # verified just above
        except DataStateMismatchError as error:
            step = latest.name.removeprefix("step-").lstrip("0") or "0"
            raise DataStateMismatchError(
                f"cannot resume from checkpoint {latest} (step {step}): {error}") from error
        self.after_load()
        self.resumed_from = latest
        if self.is_main:
            print(f"resumed from {latest} (step {self.progress.step})", file=sys.stderr)
        self._note_world_size_change(latest, len(tree["rng"].available_ranks or ()),
                                     collective.world_size() if world_size is None
                                     else world_size)
        return str(latest)

    def _note_world_size_change(self, checkpoint: Any, saved: int, world_size: int) -> None:
        """Print and record in ``run_history.jsonl`` a resume on another number of ranks than
        wrote the checkpoint (DCP reshards it; an elastic restart on fewer nodes lands here).
        ``saved``: the writers, counted by `load_checkpoint` from their per-rank generator
        entries."""
        from densetrain.checkpoint.resume import append_history

        if not saved or saved == world_size:
            return
        if self.is_main:
            print(f"world size changed: checkpoint {checkpoint} was written by {saved} ranks, "
                  f"this run has {world_size} (resharded on load)", file=sys.stderr)
        append_history(self.run_dir, {"event": "world_size_changed", "step": self.progress.step,
                                      "from": saved, "to": world_size,
                                      "checkpoint": str(checkpoint)})

    # -- saving -----------------------------------------------------------------------------

    def open(self) -> Any:
        """The writer of this run's checkpoints (`AsyncCheckpointer`), made on the first call
        (collective: with ``async_save`` it creates the checkpoint group)."""
        if self._writer is None:
            from densetrain.checkpoint.async_save import AsyncCheckpointer

            self._writer = AsyncCheckpointer(
                self.directory, config_toml=self.config_toml, keep_last=self.keep_last,
                async_save=self.async_save, timeout_s=self.timeout_s,
            )
        return self._writer

    def save(self, step: int, *, wait: bool = False) -> None:
        """Save the tree as ``step-<step>`` (a step just saved is not saved again).

        One ``state_dict()`` of the tree and one finiteness check of all of it (model,
        optimizer, anything with tensors; one host sync), which the writer then takes as done:
        `NonFiniteStateError` names the first NaN/inf tensor and nothing is written. In the
        background with ``async_save`` (returns once staged) unless ``wait``. Raises
        `CheckpointError` for a failed save (this one, or the one before still in flight).
        """
        from densetrain.checkpoint.saving import check_state_finite

        writer = self.open()
        tree = check_state_finite(self.tree(), step)
        writer.save(step, tree, checked=True)
        if wait:
            writer.wait()

    def wait(self) -> Path | str | None:
        """Block until a save in flight is complete; the newest checkpoint written (or None).
        Raises `CheckpointError` when that save failed."""
        return self._writer.wait() if self._writer is not None else None

    @property
    def has_pending(self) -> bool:
        """True when a background save was started and `wait` has not collected it yet."""
        return self._writer is not None and self._writer.has_pending

    @property
    def settled(self) -> bool:
        """True when a background save has ended (sealed or failed) on this rank and `wait`
        has not collected it yet; never blocks."""
        return self._writer is not None and self._writer.settled

    def settled_everywhere(self) -> bool:
        """`settled` on every rank (collective: all ranks get the same answer, so they collect
        a background save at the same step)."""
        settled = self.settled
        if collective.dist_on():
            import torch
            import torch.distributed as dist

            flag = torch.tensor([1 if settled else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            settled = bool(flag.item())
        return settled

    @property
    def last_path(self) -> Path | str | None:
        """The newest complete checkpoint this session wrote (or None)."""
        return self._writer.last_path if self._writer is not None else None

    def close(self) -> None:
        """Wait for a save still in flight (reporting, not raising, its failure) and stop the
        writer's thread; a later save opens a new writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- rollback ---------------------------------------------------------------------------

    def newest_at_most(self, step: int) -> tuple[int, Path] | None:
        """The newest complete checkpoint of step <= ``step`` as ``(step, path)``, or None."""
        return newest_at_most(self.directory, step)

    def rollback(self, at_most: int) -> tuple[int, Path] | None:
        """Load the newest complete checkpoint of step <= ``at_most`` into the tree and return
        ``(step, path)``; None (nothing changed) when there is none.

        A save still in flight is completed first (it may be the one to load; a failure
        raises `CheckpointError`). The checkpoints after the one loaded are deleted (their
        trajectory is abandoned: a later save of the same step must not find them) by the
        main rank while the others wait. The fault record is not loaded: it keeps what
        happened since that checkpoint.
        """
        self.wait()
        target = self.newest_at_most(at_most)
        if target is None:
            return None
        to_step, path = target
        remove_checkpoints_after(self.directory, to_step, is_main=self.is_main)
        collective.barrier()  # no rank loads while the main rank still deletes
        tree = self.tree(as_in=path)
        tree.pop("faults", None)
        load_checkpoint(path, tree)
        self.after_load()
        return to_step, path


class _DataStateBeforeContent:
    """The data stream's state as a checkpoint saved before contents were recorded holds it:
    the same entries but ``content``, loaded (and checked) on those."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def state_dict(self) -> dict:
        from densetrain.data.stream import CONTENT_KEY

        return {k: v for k, v in self.stream.state_dict().items() if k != CONTENT_KEY}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def load_model_weights(source: str | os.PathLike, model: Any, *, group: Any = None
                       ) -> Path | str | None:
    """Copy the model weights of the newest training checkpoint at ``source`` that verifies
    (a ``step-N``, a directory of them or a run directory: `open_training_checkpoint`) into
    ``model`` (a module); returns that checkpoint's path, or None when ``source`` holds no
    training checkpoint. Collective when a process group is up."""
    from densetrain.checkpoint.reading import open_training_checkpoint

    found = open_training_checkpoint(source, group=group)
    if found is None:
        return None
    load_checkpoint(found.path, {"model": ModelState(model)}, verify=False)  # just verified
    return found.path
