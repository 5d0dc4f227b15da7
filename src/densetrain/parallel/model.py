"""`LaidOutModel`: a model on its layout, with one interface for every layout.

The trainer, the evaluator and the sampler talk to this object only: it moves a batch to the
device and takes this rank's share of it (`prepare_batch`: context parallel holds 1/cp of every
sequence), runs forward and backward over a rank's batch (`forward_backward`: gradient
accumulation over micro-batches, or the pipeline schedule), evaluates (`eval_loss`) and gathers
the full weights to global rank 0's CPU, tensor by tensor (`gathered_state_dict`, for sampling
and export). `LaidOutModel` is the interface; the layout picks its implementation once, where the
model is built: `SpmdModel` (one module, every rank running the same program: DDP, FSDP, tensor
and context parallel) or `PipelineParallelModel` (this rank's stages under a pipeline schedule).
What differs between the two lives in their methods; what they share is the base's
(`prepare_batch`, `cp_size`) or a module-level function.

Shape legend: B batch rows, S sequence.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from densetrain.errors import UserError
from densetrain.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from densetrain.parallel.pipeline import Pipeline

LossFn = Callable[[nn.Module, Any], Any]
"""``loss_fn(module, micro_batch) -> LossOutput`` (``.loss`` differentiable, ``.ce_loss``)."""
Autocast = Callable[[], AbstractContextManager[None]]


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """The data-parallel gradient reduction of a non-final micro-batch (``enabled`` False).

    DDP (composable ``replicate``) skips it: its gradients are whole on every rank anyway, and
    one all-reduce at the end moves the least. FSDP2 (ZeRO-3) reduce-scatters every micro-batch,
    as ZeRO does: skipping it would accumulate *unsharded* gradients, the whole model's in fp32
    on every rank (a dry run of Llama 3 8B on FSDP 8: 91.2 GiB per rank against 61.3 with it);
    under HSDP only the all-reduce over the replicas waits for the final micro-batch. Anything
    else (one process, ZeRO-1/2's own optimizer) needs nothing.
    """
    from torch.distributed.fsdp import FSDPModule

    if enabled or not hasattr(module, "set_requires_gradient_sync"):
        yield
        return
    if isinstance(module, FSDPModule):
        module.set_requires_all_reduce(False)
        try:
            yield
        finally:
            module.set_requires_all_reduce(True)
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def split_micro_batches(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a rank's batch (a dataclass of [b, S] tensors or None) into micro-batches."""
    rows = batch.inputs.shape[0]
    if rows % micro_batch_size != 0:
        raise UserError(
            f"the rank's batch of {rows} sequences is not divisible by training.micro_batch_size="
            f"{micro_batch_size}"
        )
    if rows == micro_batch_size:
        return [batch]
    pieces = []
    for start in range(0, rows, micro_batch_size):
        chunk = {
            k: (v[start : start + micro_batch_size] if isinstance(v, torch.Tensor) else v)
            for k, v in vars(batch).items()
        }
        pieces.append(type(batch)(**chunk))
    return pieces


def model_loss_fn(chunk_size: int | None) -> LossFn:
    """The loss through the model's own ``forward`` (``targets_BS``): the chunked head with
    ``chunk_size``, the model's ``loss_head`` (vocab-parallel under tensor parallel)."""

    def loss_fn(module: nn.Module, batch: Any):
        return module(batch.inputs, targets_BS=batch.targets, positions_BS=batch.positions,
                      document_ids_BS=batch.document_ids, loss_chunk_size=chunk_size)

    return loss_fn


@dataclass(kw_only=True)
class LaidOutModel(abc.ABC):
    """A (possibly sharded, possibly pipelined) model and how to train, evaluate and gather it.

    The interface only: the layout is chosen once, where the model is built
    (`parallel.build.build_model`), as one of two implementations, so that no method asks
    which layout it runs on. `SpmdModel` runs one module whose ranks all execute the same
    program (DDP, FSDP, tensor and context parallel, composed); `PipelineParallelModel` runs
    this rank's pipeline stages through their schedule.

    ``module`` holds this rank's parameters under the full model's names (what optimizers and
    checkpoints see); ``pipeline`` is the stages' schedule, None unless pipelined (then
    ``module`` is not callable).
    """

    module: nn.Module
    pmesh: ParallelMesh | None = None
    ignore_index: int = -100
    pipeline: ClassVar[Pipeline | None] = None

    @property
    def is_pipelined(self) -> bool:
        """Whether a pipeline schedule runs the model (pp > 1)."""
        return self.pipeline is not None

    # ------------------------------------------------------------------ batches
    @property
    def cp_size(self) -> int:
        """Context-parallel degree (ranks sharing every sequence)."""
        return 1 if self.pmesh is None else self.pmesh.dims.cp

    def prepare_batch(self, batch: Any, device: torch.device) -> Any:
        """``batch`` on ``device``; with context parallel, this rank's load-balanced share of
        every sequence (`parallel.context.shard_sequence`) with its global positions (restarting
        per document) and document ids."""
        moved = {k: (_to_device(v, device) if isinstance(v, torch.Tensor) else v)
                 for k, v in vars(batch).items()}
        batch = type(batch)(**moved)
        if self.cp_size == 1:
            return batch
        from densetrain.models.transformer import document_positions
        from densetrain.parallel.context import shard_sequence

        cp, cp_rank = self.cp_size, self.pmesh.local_rank("cp")
        rows, seq_len = batch.inputs.shape
        positions_BS = batch.positions
        if positions_BS is None:
            # Over the whole sequence: a document's positions restart where it starts, which
            # may be on another cp rank.
            index_1S = torch.arange(seq_len, device=device).unsqueeze(0)
            positions_BS = document_positions(batch.document_ids, index_1S).expand(rows, seq_len)
        docs_BS = batch.document_ids
        return type(batch)(
            inputs=shard_sequence(batch.inputs, cp_rank, cp),
            targets=shard_sequence(batch.targets, cp_rank, cp),
            positions=shard_sequence(positions_BS, cp_rank, cp),
            document_ids=None if docs_BS is None else shard_sequence(docs_BS, cp_rank, cp),
        )

    # ------------------------------------------------------------------ training
    @abc.abstractmethod
    def forward_backward(
        self, batch: Any, *, micro_batch_size: int, autocast: Autocast
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of this rank's (prepared) batch; returns ``(loss, tokens)``:
        the token-weighted mean loss of the whole sequences this rank's group trains on and the
        number of target tokens, both on the device (no host sync)."""

    # ------------------------------------------------------------------ evaluation
    @abc.abstractmethod
    def eval_loss(self, batch: Any, *, micro_batch_size: int, autocast: Autocast
                  ) -> torch.Tensor:
        """Token-weighted mean cross-entropy of this rank's (prepared) batch, without
        gradients."""

    # ------------------------------------------------------------------ full weights
    @abc.abstractmethod
    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded weights under the full model's names, on the CPU of global rank 0
        only; every other rank returns ``{}`` (a collective: every rank must call it).

        The weights are gathered tensor by tensor, so that no rank ever holds more than one full
        tensor on its device and only rank 0 holds the model (in host memory).
        """


@dataclass(kw_only=True)
class SpmdModel(LaidOutModel):
    """One module on every rank of the layout, called directly: one process, DDP, FSDP
    (ZeRO-1/2/3, HSDP), tensor and context parallel. A step accumulates gradients over
    micro-batches (`_accumulate`) with ``loss_fn``."""

    loss_fn: LossFn = dataclasses.field(default_factory=lambda: model_loss_fn(None))
    before_reduction: Callable[[], None] | None = None
    """Called before the last micro-batch's backward, whose gradient reduction the ranks meet
    in (the straggler monitor's mark under plain DDP; `train.stragglers`)."""

    def forward_backward(
        self, batch: Any, *, micro_batch_size: int, autocast: Autocast
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient accumulation over the batch's micro-batches of ``micro_batch_size`` rows."""
        return self._accumulate(split_micro_batches(batch, micro_batch_size), autocast)

    def _accumulate(
        self, micro_batches: Sequence[Any], autocast: Autocast
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient accumulation: each micro-batch's mean loss weighted by its share of the
        rank's target tokens, so the gradient is that of the mean over all tokens of the step.

        With context parallel the token count is summed over the cp group and the gradient
        multiplied by its size, because the data-parallel reduction (FSDP over dp_shard × cp)
        averages over cp ranks where the loss needs their sum; the loss returned is that of the
        whole sequences (summed over the group).
        """
        counts = [(b.targets != self.ignore_index).sum() for b in micro_batches]
        total_tokens = torch.stack(counts).sum()
        cp_group = self.pmesh.group("cp") if self.pmesh is not None else None
        if cp_group is not None:
            dist.all_reduce(total_tokens, group=cp_group)
        total_tokens = total_tokens.clamp(min=1)
        loss_sum = torch.zeros((), device=micro_batches[0].inputs.device)
        last = len(micro_batches) - 1
        for index, (batch, count) in enumerate(zip(micro_batches, counts, strict=True)):
            with gradient_sync(self.module, enabled=index == last):
                with autocast():
                    output = self.loss_fn(self.module, batch)
                weight = count.to(output.loss.dtype) / total_tokens
                if index == last and self.before_reduction is not None:
                    self.before_reduction()
                (output.loss * (weight * self.cp_size)).backward()
            loss_sum = loss_sum + output.loss.detach().float() * weight
        if cp_group is not None:
            dist.all_reduce(loss_sum, group=cp_group)
        return loss_sum, total_tokens

    @torch.no_grad()
    def eval_loss(self, batch: Any, *, micro_batch_size: int, autocast: Autocast
                  ) -> torch.Tensor:
        """The mean of ``loss_fn``'s cross-entropy over micro-batches, weighted by their tokens,
        with the module in eval mode."""
        self.module.eval()
        try:
            total = torch.zeros((), device=batch.inputs.device)
            tokens = torch.zeros((), device=batch.inputs.device)
            for micro in split_micro_batches(batch, micro_batch_size):
                with autocast():
                    out = self.loss_fn(self.module, micro)
                total += out.ce_loss.float() * out.num_tokens
                tokens += out.num_tokens
            return total / tokens.clamp(min=1)
        finally:
            self.module.train()

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Sharded (FSDP/TP) tensors go through ``get_model_state_dict(full_state_dict=True,
        cpu_offload=True)``, which gathers them one by one and keeps each on global rank 0
        only; without a device mesh (one process) the module's own tensors are copied."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        if self.pmesh is None or self.pmesh.device_mesh is None:
            return {k: v.detach().cpu() for k, v in get_model_state_dict(self.module).items()}
        # With cpu_offload, torch keeps each gathered tensor on (global) rank 0 only and
        # returns an empty dict elsewhere (``ranks_only=(0,)`` in ``_gather_state_dict``).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.module, options=options)
        return {k: v.detach() for k, v in full.items()}


@dataclass(kw_only=True)
class PipelineParallelModel(LaidOutModel):
    """This rank's pipeline stages (`parallel.pipeline.Pipeline`), each possibly sharded
    within its stage (FSDP, TP, CP), run by the pipeline schedule; ``module`` is their
    `parallel.pipeline.PipelinedModel` (not callable). The schedule splits the batch into its
    own microbatches, so ``micro_batch_size`` is not used here, and runs the plain causal mask
    only. The last stage computes the loss; every method that returns one shares it over the
    pp group (`_share_over_pp`), so every rank reports it."""

    pipeline: Pipeline = dataclasses.field()

    def prepare_batch(self, batch: Any, device: torch.device) -> Any:
        """As `LaidOutModel.prepare_batch`; a batch with document ids or positions is refused
        (the stages' forward takes the tokens only)."""
        if batch.document_ids is not None or batch.positions is not None:
            raise UserError("pipeline parallel runs the plain causal mask only; turn off "
                            "document masking in the data config")
        return super().prepare_batch(batch, device)

    def forward_backward(
        self, batch: Any, *, micro_batch_size: int, autocast: Autocast
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One schedule step: it averages its microbatches' losses on the last stage; the mean
        is summed over the pp group (the other stages add zero)."""
        with autocast():
            loss = self.pipeline.step(batch.inputs, batch.targets)
            return self._share_over_pp(loss, batch), (batch.targets != self.ignore_index).sum()

    @torch.no_grad()
    def eval_loss(self, batch: Any, *, micro_batch_size: int, autocast: Autocast
                  ) -> torch.Tensor:
        """The schedule's forward-only pass over the whole batch gives the stage loss
        (cross-entropy plus the z-loss term when ``z_loss_coef`` > 0)."""
        with autocast():
            return self._share_over_pp(self.pipeline.eval(batch.inputs, batch.targets), batch)

    def _share_over_pp(self, loss: torch.Tensor | None, batch: Any) -> torch.Tensor:
        value = (torch.zeros((), device=batch.inputs.device) if loss is None
                 else loss.detach().float())
        dist.all_reduce(value, group=self.pmesh.group("pp"))
        return value

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank gathers its stages' tensors one at a time within the stage (the all-gather
        of a DTensor runs over its own sub-mesh, the stage's dp/cp/tp ranks). Only the pp group
        that holds global rank 0 (the ranks whose other mesh coordinates are all 0) exchanges
        anything: its other members first send rank 0 their tensors' names, shapes and dtypes
        (one ``gather_object`` over that group), then each gathered tensor (``send``), which rank
        0 receives into one buffer on its device at a time and moves to the CPU.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        pp_group = self.pmesh.group("pp")
        pp_ranks = dist.get_process_group_ranks(pp_group)
        rank = dist.get_rank()
        in_root_group = 0 in pp_ranks
        device = _collective_device(self.pmesh)
        local = get_model_state_dict(self.module)  # sharded: DTensors under the full names
        for name in self.pipeline.duplicate_names:  # the first stage's rank sends it
            local.pop(name, None)
        specs = [(name, tuple(value.shape), value.dtype) for name, value in local.items()]
        stage_specs: list[Any] | None = [None] * len(pp_ranks) if rank == 0 else None
        if in_root_group:
            dist.gather_object(specs, stage_specs, group=pp_group, group_dst=0)
        merged: dict[str, torch.Tensor] = {}
        for name, value in local.items():
            full = _full_tensor(value, device)
            if rank == 0:
                merged[name] = full.cpu()
            elif in_root_group:
                dist.send(full.contiguous(), group=pp_group, group_dst=0)
            del full
        if rank != 0:
            return {}
        assert stage_specs is not None
        for source in range(1, len(pp_ranks)):
            for name, shape, dtype in stage_specs[source]:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, group=pp_group, group_src=source)
                merged[name] = buffer.cpu()
        return merged


def _collective_device(pmesh: ParallelMesh) -> torch.device:
    """The device this rank's collectives on ``pmesh`` run on (its CUDA device, or the CPU)."""
    device_type = pmesh.device_mesh.device_type
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _full_tensor(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The full tensor of a state-dict entry on ``device``: a DTensor all-gathered over its own
    mesh (a collective of its ranks), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if value.device.type != device.type:  # e.g. FSDP's CPU offload
            value = value.to(device)
        return value.full_tensor().detach()
    return value.detach().to(device)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a host-to-GPU copy goes through pinned memory so that it is
    asynchronous (from pageable memory ``non_blocking`` copies synchronously)."""
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
