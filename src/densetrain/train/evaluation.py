"""Validation loss and the sample continuation, through the `LaidOutModel` interface (the same
code under every layout: pipeline, tensor and context parallel included).

The validation loss is taken on a fixed set of windows of the validation split (`ValidationSet`):
the split's packed sequences (``seq_len + 1`` tokens at multiples of ``seq_len``, each source's
in turn, as one list) or ``eval.num_windows`` of them at evenly spaced positions of that list. The
set depends on the dataset and ``seq_len`` alone, never on ``data.seed``, the batch size or the
number of ranks, so runs that differ in those evaluate the very same tokens; its identity
(``val_set``: windows, tokens per window and a hash of the data and the positions) is logged with
every validation loss and in the summary so that two runs can be checked to be comparable.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from densetrain.data.stream import Batch, BatchStream
from densetrain.data.stream import _segment_info as segment_info
from densetrain.errors import UserError
from densetrain.train.state import RunParts
from densetrain.train.stragglers import blocking_point

IGNORE_INDEX = -100
"""Target of the rows that pad a rank's last validation batch (no loss, no token count)."""


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of ``value`` over every rank (a collective; the value itself on one process)."""
    value = value.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        with blocking_point():  # the loss all-reduce: time waited here is not compute
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= dist.get_world_size()
            return float(value)
    return float(value)


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` (float64) summed over every rank (a collective; itself on one process)."""
    value = value.detach().to(torch.float64).clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


@dataclass(frozen=True)
class ValidationSet:
    """The windows validation is taken on: ``(source, token offset)`` of each, in order."""

    windows: list[tuple[int, int]]
    seq_len: int
    key: str
    """Hex SHA-256 (16 digits) of ``seq_len``, each source's content key and sequence count, and
    the chosen positions: equal keys mean the same tokens."""

    def identity(self) -> dict[str, int | str]:
        """``{"val_windows", "val_window_tokens", "val_set"}``: what a run records."""
        return {"val_windows": len(self.windows), "val_window_tokens": self.seq_len,
                "val_set": self.key}

    def rank_slice(self, dp_rank: int, dp_size: int) -> list[tuple[int, int]]:
        """The contiguous share of the windows of data-parallel rank ``dp_rank`` (disjoint
        shares that cover the set; sizes differ by at most one)."""
        n = len(self.windows)
        return self.windows[dp_rank * n // dp_size:(dp_rank + 1) * n // dp_size]


def validation_set(stream: BatchStream, num_windows: int) -> ValidationSet:
    """The fixed validation windows of ``stream``'s split: all of its packed sequences when
    ``num_windows`` is 0 or at least their number, else ``num_windows`` of them at positions
    ``floor((j + 1/2) * total / num_windows)`` of the list of every source's sequences in turn.
    Independent of the stream's seed, its rank and any batch size."""
    if num_windows < 0:
        raise UserError(f"eval.num_windows must be >= 0 (0 = the whole split), got {num_windows}")
    counts = [int(n) for n in stream.num_sequences]
    total = sum(counts)
    if num_windows == 0 or num_windows >= total:
        chosen = np.arange(total, dtype=np.int64)
    else:
        chosen = ((2 * np.arange(num_windows, dtype=np.int64) + 1) * total) // (2 * num_windows)
    starts = np.cumsum([0, *counts])
    sources = np.searchsorted(starts, chosen, side="right") - 1
    offsets = (chosen - starts[sources]) * stream.seq_len
    digest = hashlib.sha256()
    digest.update(f"seq_len={stream.seq_len};".encode())
    for key, count in zip(stream.content_keys, counts, strict=True):
        digest.update(f"{key}:{count};".encode())
    digest.update(chosen.tobytes())
    windows = list(zip(sources.tolist(), offsets.tolist(), strict=True))
    return ValidationSet(windows=windows, seq_len=stream.seq_len, key=digest.hexdigest()[:16])


def read_windows(stream: BatchStream, windows: list[tuple[int, int]], rows: int) -> Batch:
    """A batch of ``rows`` rows: the ``windows`` (``seq_len + 1`` tokens each) then rows of
    the first window (or zeros) whose targets are all `IGNORE_INDEX`."""
    S = stream.seq_len
    tokens = np.zeros((rows, S + 1), dtype=np.int64)
    doc_ids = np.zeros((rows, S), dtype=np.int64) if stream.document_masking else None
    positions = np.zeros((rows, S), dtype=np.int64) if stream.document_masking else None
    for row, (source, offset) in enumerate(windows):
        store = stream.stores[source]
        tokens[row] = store.read(offset, S + 1)
        if tokens[row].max() >= store.vocab_size:
            store.check_ids(offset, tokens[row])
        if doc_ids is not None:
            doc_ids[row], positions[row] = segment_info(store.document_ids(offset, S))
    if positions is not None:
        positions[len(windows):] = np.arange(S)
    data = torch.from_numpy(tokens)
    targets = data[:, 1:].clone()
    targets[len(windows):] = IGNORE_INDEX
    return Batch(inputs=data[:, :-1].contiguous(), targets=targets.contiguous(),
                 document_ids=None if doc_ids is None else torch.from_numpy(doc_ids),
                 positions=None if positions is None else torch.from_numpy(positions))


class Evaluator:
    """Validation loss every ``interval`` steps and after the last step (``interval`` 0: never),
    over the fixed `ValidationSet` of ``num_windows`` windows (0: the whole validation split)."""

    def __init__(self, *, interval: int, num_windows: int) -> None:
        self.interval = interval
        self.num_windows = num_windows
        self._set: ValidationSet | None = None

    def due(self, step: int, total_steps: int) -> bool:
        """True on the cadence and at the last step."""
        return self.interval > 0 and (step % self.interval == 0 or step >= total_steps)

    def validation_set(self, parts: RunParts) -> ValidationSet | None:
        """The run's validation windows (None without validation data)."""
        if parts.data.val is None:
            return None
        if self._set is None:
            self._set = validation_set(parts.data.val, self.num_windows)
        return self._set

    def summary(self) -> dict[str, int | str]:
        """The identity of the validation set evaluated (empty when none was)."""
        return self._set.identity() if self._set is not None else {}

    @torch.no_grad()
    def evaluate(self, parts: RunParts) -> dict[str, float | int | str]:
        """``{"val_loss", "val_ppl", "val_tokens"}`` and the set's identity (empty without
        validation data): the sum of every window's token losses over their token count, each
        data-parallel rank taking its share of the windows (a collective).

        Every rank runs the same number of batches of ``global_batch_size // dp_size`` rows (a
        shape valid on every layout); the last rows of a rank's last batch may be padding whose
        targets are ignored."""
        val_set = self.validation_set(parts)
        if val_set is None or self.interval <= 0:
            return {}
        stream = parts.data.val
        dp_size = parts.dp_size
        rows = parts.settings.global_batch_size // dp_size
        mine = val_set.rank_slice(parts.pmesh.dp_rank, dp_size)
        batches = math.ceil(math.ceil(len(val_set.windows) / dp_size) / rows)
        total = torch.zeros((), dtype=torch.float64, device=parts.device)
        tokens = torch.zeros((), dtype=torch.float64, device=parts.device)
        for i in range(batches):
            batch = read_windows(stream, mine[i * rows:(i + 1) * rows], rows)
            count = int((batch.targets != IGNORE_INDEX).sum())
            prepared = parts.model.prepare_batch(batch, parts.device)
            loss = parts.model.eval_loss(prepared, autocast=parts.autocast,
                                         micro_batch_size=parts.settings.micro_batch_size)
            total += loss.double() * count
            tokens += count
        # Ranks of one data-parallel group hold the same windows: the sums over all ranks count
        # each window equally often, so their ratio is the mean over the set.
        sums = sum_over_ranks(torch.stack([total, tokens]))
        val_loss = float(sums[0] / sums[1])
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
                "val_tokens": len(val_set.windows) * val_set.seq_len, **val_set.identity()}


@dataclass(frozen=True)
class SampleSpec:
    """How the run's sample is drawn (``eval.sample_*``; the seed is ``training.seed``)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    """0: no limit."""
    top_p: float
    """1: no limit."""
    seed: int

    def describe(self) -> str:
        """``greedy`` or ``temperature 0.8, top-k 40, top-p 0.95, seed 0`` (the limits set)."""
        if self.temperature == 0:
            return "greedy"
        words = [f"temperature {self.temperature:g}"]
        if self.top_k:
            words.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            words.append(f"top-p {self.top_p:g}")
        return ", ".join([*words, f"seed {self.seed}"])


def validation_prompt(parts: RunParts, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens (at most one sequence, ``seq_len``) of the validation
    split's first source that holds a sequence: text the model was never trained on. Raises a
    `UserError` naming the fields to set when the run has no validation data."""
    val = parts.data.val
    sources = [] if val is None else [
        store for store, count in zip(val.stores, val.num_sequences, strict=True) if count > 0]
    if not sources:
        raise UserError("eval.sample_prompt is empty, so the sample's prompt is taken from the "
                        "validation split, and this run has none: set eval.sample_prompt, or "
                        "eval.sample_tokens=0 for no sample")
    return [int(t) for t in sources[0].read(0, min(num_tokens, val.seq_len))]


@torch.no_grad()
def sample_text(parts: RunParts, prompt_ids: list[int], spec: SampleSpec) -> str:
    """KV-cached continuation of ``prompt_ids`` by the run's model as ``spec`` says, on rank 0
    ("" elsewhere).

    A collective: every rank takes part in gathering the full weights of a sharded or pipelined
    model to rank 0 (`LaidOutModel.gathered_state_dict`); one process generates from its own
    module directly. Rank 0 first checks that the full model fits in its host memory and, on a
    CUDA device, in its free device memory (`sample_fits`); when it does not, every rank skips
    the sample and returns "". Only rank 0 draws, so there is one sample per run whatever the
    layout; a fresh generator seeded with ``spec.seed`` for each sample makes it the same text
    for the same weights: a rerun, a resumed run and another layout of the same job agree, and
    samples at different steps differ by the model alone.
    """
    from densetrain.generate import generate
    from densetrain.models import Transformer

    tokenizer = parts.data.tokenizer
    if parts.world_size == 1:
        model = parts.model.module
    else:
        if not sample_fits(parts):
            return ""
        weights = parts.model.gathered_state_dict()
        if not parts.is_main:
            return ""
        # Built on the meta device and given the gathered tensors (moved to the device one by
        # one), so the full model is never allocated twice.
        with torch.device("meta"):
            model = Transformer(parts.model_cfg)
        model.load_state_dict({name: weights.pop(name).to(parts.device) for name in list(weights)},
                              assign=True)
    tokens_1S = torch.tensor([prompt_ids], dtype=torch.long, device=parts.device)
    generator = torch.Generator(device=parts.device).manual_seed(spec.seed)
    model.eval()
    try:
        with parts.autocast():
            out_1T = generate(model, tokens_1S, spec.max_new_tokens,
                              temperature=spec.temperature, top_k=spec.top_k or None,
                              top_p=spec.top_p if spec.top_p < 1 else None,
                              eos_token_id=tokenizer.eos_id, generator=generator)
    finally:
        model.train()
    new = out_1T[0, len(prompt_ids):].tolist()
    if tokenizer.eos_id in new:  # generate pads a finished sequence with EOS
        new = new[:new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)


def full_model_bytes(parts: RunParts) -> int:
    """Bytes of the full model's parameters: the parameter count of ``parts.model_cfg``
    (`models.sizing.param_counts`) times the widest element size of this rank's parameters."""
    from densetrain.models.sizing import param_counts

    itemsize = max((p.dtype.itemsize for p in parts.model.module.parameters()), default=4)
    return param_counts(parts.model_cfg).total * itemsize


def available_memory(device: torch.device) -> list[tuple[str, int]]:
    """What this process can still allocate, as ``(which memory, bytes)``: the host's available
    memory (`host_available_bytes`; left out when unknown) and, on a CUDA device, its free
    memory (``torch.cuda.mem_get_info`` plus what the caching allocator holds unused)."""
    available = []
    host = host_available_bytes()
    if host is not None:
        available.append(("available host memory", host))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        available.append((f"free memory on {device}", free + cached))
    return available


def host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (the available physical pages on systems without
    it), capped by the cgroup v2 memory limit left to this process when one is set; None when
    neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, max(int(limit) - used, 0))


def sample_fits(parts: RunParts) -> bool:
    """Whether rank 0 can hold the full model for the sample (a collective).

    Rank 0 compares `full_model_bytes` with each memory of `available_memory` and, when one is
    short, prints one line saying so; its decision reaches every rank in one broadcast over
    the mesh's ranks, so that all of them skip the gathering together.
    """
    fits = True
    if parts.is_main:
        needed = full_model_bytes(parts)
        short = [(what, have) for what, have in available_memory(parts.device) if have < needed]
        if short:
            fits = False
            have = "; ".join(f"{what}: {n:,} bytes ({n / 2**30:.2f} GiB)" for what, n in short)
            print(f"sample skipped: the full model needs {needed:,} bytes "
                  f"({needed / 2**30:.2f} GiB) on rank 0, more than its {have}", file=sys.stderr)
    flag = torch.tensor([int(fits)], dtype=torch.int32, device=parts.device)
    dist.broadcast(flag, group=_world_group(parts), group_src=0)
    return bool(flag.item())


def _world_group(parts: RunParts):
    """The process group of every rank of the mesh: its own group when it has one axis; else
    the default group, which `ParallelDims.build_mesh` lays the whole mesh over."""
    mesh = parts.pmesh.device_mesh if parts.pmesh is not None else None
    if mesh is not None and mesh.ndim == 1:
        return mesh.get_group()
    return None
