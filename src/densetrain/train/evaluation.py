"""Validation loss and the sample continuation, through the `LaidOutModel` interface (the same
code under every layout: pipeline, tensor and context parallel included)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from densetrain.train.state import RunParts


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of ``value`` over every rank (a collective; the value itself on one process)."""
    value = value.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


class Evaluator:
    """Validation loss every ``interval`` steps and after the last step (``interval`` 0: never),
    over ``num_batches`` fixed validation batches."""

    def __init__(self, *, interval: int, num_batches: int) -> None:
        self.interval = interval
        self.num_batches = num_batches

    def due(self, step: int, total_steps: int) -> bool:
        """True on the cadence and at the last step."""
        return self.interval > 0 and (step % self.interval == 0 or step >= total_steps)

    @torch.no_grad()
    def evaluate(self, parts: RunParts) -> dict[str, float]:
        """``{"val_loss", "val_ppl"}`` averaged over the ranks (empty without validation data)."""
        if parts.data.val is None or self.interval <= 0:
            return {}
        # Batches of the training global batch size: valid on every layout, so every layout
        # evaluates the same validation sequences.
        rows = parts.training.global_batch_size
        total = torch.zeros((), device=parts.device)
        for batch in parts.data.val.iter_eval(self.num_batches, rows):
            prepared = parts.model.prepare_batch(batch, parts.device)
            total += parts.model.eval_loss(prepared, autocast=parts.autocast,
                                           micro_batch_size=parts.training.micro_batch_size)
        val_loss = mean_over_ranks(total / self.num_batches)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


@torch.no_grad()
def sample_text(parts: RunParts, prompt: str, max_new_tokens: int) -> str:
    """Greedy KV-cached continuation of ``prompt`` by the run's model, on rank 0 ("" elsewhere).

    A collective: every rank takes part in gathering the full weights of a sharded or pipelined
    model to rank 0 (`LaidOutModel.gathered_state_dict`); one process generates from its own
    module directly. Rank 0 first checks that the full model fits in its host memory and, on a
    CUDA device, in its free device memory (`sample_fits`); when it does not, every rank skips
    the sample and returns "".
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
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    tokens_1S = torch.tensor([ids], dtype=torch.long, device=parts.device)
    model.eval()
    try:
        with parts.autocast():
            out_1T = generate(model, tokens_1S, max_new_tokens, eos_token_id=tokenizer.eos_id)
    finally:
        model.train()
    text = tokenizer.decode(out_1T[0, len(ids):].tolist())
    if parts.is_main:
        print(f"sample (greedy) | {prompt!r} ->\n{prompt}{text}\n", file=sys.stderr)
    return text


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
