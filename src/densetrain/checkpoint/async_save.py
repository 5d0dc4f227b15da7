"""Checkpoints written in the background: `torch.distributed.checkpoint.async_save`.

`AsyncCheckpointer.save` stages the state to CPU memory (DCP's default stager copies every
tensor, so training may change the originals at once) and returns; DCP writes the shards on its
own thread, and a second thread of ours then seals the checkpoint exactly as a synchronous save
does (config, manifest, rename: `saving.seal_checkpoint`), so a background save is visible only
when complete and verified by the same manifest. At most one save is in flight: the next
`save` first waits for the previous one. `wait()` blocks until the save in flight is sealed and
re-raises its failure; the trainer waits after the final save and before exiting on a signal,
and collects a save that has ended (`settled`) after every step, so a failed background save
is reported at the step after it ended, not at the next save. A failed save leaves nothing
named ``step-N``: its ``.tmp`` directory is removed and the earlier checkpoints stay as they
were.

The background collectives (DCP's plan/finish and the seal) run on a dedicated gloo group, never
on the training group, so they cannot interleave with the training collectives. With
``async_save=False`` the same object saves synchronously, so the caller has one interface.
Under a URL (``s3://...``, objstore.py) there is no ``.tmp`` to rename: DCP's fsspec writer puts
the shards straight under ``step-N/`` in the background, and the seal then writes config and
manifest (last) with `objstore.seal`; a failed background save leaves a prefix without a
manifest, which is never taken as a checkpoint (rank 0 deletes it, best effort).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from densetrain.checkpoint import collective, objstore
from densetrain.checkpoint.manager import CheckpointError, checkpoint_name, materialise
from densetrain.checkpoint.saving import (
    begin_save,
    check_finite,
    save_failure,
    seal_checkpoint,
    write_shards,
)
from densetrain.errors import RankFailure


def _own_objects(tree: Any) -> Any:
    """``tree`` with its containers and non-tensor leaves copied (tensors are staged by DCP),
    so that a later change to trainer state cannot leak into a save still being written."""
    if isinstance(tree, Mapping):
        return {k: _own_objects(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_own_objects(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return tree
    return copy.deepcopy(tree)


class AsyncCheckpointer:
    """Saves of one checkpoint directory, in the background (``async_save``) or not.

    ``timeout_s`` bounds each background collective (the training collective timeout).
    ``stall_seconds`` records, per save, how long `save` blocked the caller.
    """

    def __init__(self, directory: str | os.PathLike, *, config_toml: str | None,
                 keep_last: int, async_save: bool = True, timeout_s: float = 600.0) -> None:
        self.remote = objstore.is_remote(directory)
        self.root: Any = str(directory).rstrip("/") if self.remote else Path(directory)
        self.config_toml = config_toml
        self.keep_last = keep_last
        self.async_save = async_save
        self.group = collective.new_cpu_group(timeout_s) if async_save else None
        self._executor = ThreadPoolExecutor(1, "checkpoint-seal") if async_save else None
        self._pending: Future | None = None
        self.last_path: Any = None
        self.stall_seconds: list[float] = []

    def save(self, step: int, state: Mapping[str, Any], *, checked: bool = False) -> None:
        """Save the Stateful tree ``state`` as ``step-<step>`` (collective). Asynchronous: returns
        once the state is staged; a failure of the previous save is raised here. ``checked``:
        the caller has already refused non-finite values (`saving.check_state_finite`), so
        the model is not checked again."""
        start = time.perf_counter()
        self.wait()
        if self.last_path is not None and Path(self.last_path).name == checkpoint_name(step):
            return
        tree = materialise(state)
        if not checked:
            check_finite(tree, "model", step)
        if self.remote:
            self._save_remote(step, tree)
            self.stall_seconds.append(time.perf_counter() - start)
            return
        tmp = begin_save(self.root, step)
        if tmp is None:
            self.last_path = self.root / checkpoint_name(step)
        elif not self.async_save:
            write_shards(tree, tmp, step)
            self.last_path = self._seal(tmp, step)
        else:
            self._start(_own_objects(tree), tmp, step)
        self.stall_seconds.append(time.perf_counter() - start)

    def _save_remote(self, step: int, tree: dict[str, Any]) -> None:
        if not self.async_save:
            self.last_path = objstore.save(self.root, step, tree, config_toml=self.config_toml,
                                           keep_last=self.keep_last)
            return
        final, skip = objstore.begin(self.root, step, self.group)
        if skip:
            self.last_path = final
            return
        try:
            collective.quiet_single_process_notice()
            storage = objstore.writer(final)
            written = dcp.async_save(_own_objects(tree), storage_writer=storage,
                                     process_group=self.group, no_dist=not collective.dist_on())
        except BaseException as err:
            self._drop_remote(final)
            raise save_failure(err, final, step, lambda e: objstore.describe_failure(
                e, final, step)) from err
        assert self._executor is not None
        self._pending = self._executor.submit(self._finish_remote, written, storage, final, step)

    def _finish_remote(self, written: Future, storage: Any, final: str, step: int) -> str:
        """Background: wait for DCP's write to the store, then config and manifest."""
        try:
            written.result()
        except BaseException as err:
            self._drop_remote(final)
            raise save_failure(err, final, step, lambda e: objstore.describe_failure(
                e, final, step)) from err
        return objstore.seal(self.root, final, step, config_toml=self.config_toml,
                             keep_last=self.keep_last, written=storage.written(),
                             group=self.group)

    @staticmethod
    def _drop_remote(final: str) -> None:
        """Delete the manifest-less prefix of a failed save (best effort: left, it is partial
        and skipped anyway)."""
        if collective.rank() == 0:
            try:
                objstore.remove(final)
            except Exception:
                pass

    def _start(self, tree: dict[str, Any], tmp: Path, step: int) -> None:
        try:
            collective.quiet_single_process_notice()  # issued from DCP's writer thread
            written = dcp.async_save(tree, checkpoint_id=tmp, process_group=self.group,
                                     no_dist=not collective.dist_on())
        except BaseException as err:
            failure = save_failure(err, self.root, step)
            if collective.rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise failure from err
        assert self._executor is not None
        self._pending = self._executor.submit(self._finish, written, tmp, step)

    def _finish(self, written: Future, tmp: Path, step: int) -> Path:
        """Background: wait for DCP's write, then seal (on the checkpoint group)."""
        try:
            written.result()
        except BaseException as err:
            failure = save_failure(err, self.root, step)
            if collective.rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise failure from err
        return self._seal(tmp, step)

    def _seal(self, tmp: Path, step: int) -> Path:
        return seal_checkpoint(tmp, step=step, config_toml=self.config_toml,
                               keep_last=self.keep_last, group=self.group)

    @property
    def in_flight(self) -> bool:
        """True while a background save has not been sealed yet."""
        return self._pending is not None and not self._pending.done()

    @property
    def has_pending(self) -> bool:
        """True when a background save was started and `wait` has not collected it yet."""
        return self._pending is not None

    @property
    def settled(self) -> bool:
        """True when a background save was started and has ended, sealed or failed, without
        `wait` having collected it yet (never blocks): `wait` then returns at once."""
        return self._pending is not None and self._pending.done()

    def wait(self) -> Path | None:
        """Block until the save in flight is sealed; return the newest checkpoint written (or
        None). Raises `CheckpointError` when that save failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.last_path = pending.result()
        return self.last_path

    def close(self) -> None:
        """Wait for the save in flight (reporting, not raising, its failure) and stop."""
        try:
            self.wait()
        except (CheckpointError, RankFailure) as err:  # reported; the run is ending anyway
            print(f"the last checkpoint could not be completed: {err}", file=sys.stderr)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
