"""Pipeline parallel through ``torch.distributed.pipelining``: split by layers, one schedule.

The model is split into ``pp × pp_virtual_stages`` stages of consecutive layers (balanced, or
``pp_layer_split``); the first stage keeps the token embedding, the last the final norm and
output head. Rank r of the pp group holds stage r (and r + pp, r + 2·pp, ... with interleaved
schedules; r and 2·pp − 1 − r with the V-shaped zero-bubble schedule). Each stage is then
parallelized (TP, AC, compile, FSDP) on its own by ``parallelize``.

Tied embeddings (GPT-2/GPT-3): the first stage embeds with the matrix the last stage's head
projects with. As in Megatron-LM (Narayanan et al. 2021, §3), the last stage keeps its own copy
of the matrix, ``tok_embeddings.weight`` under the same name (so the seeded init gives it the
first stage's bits, checkpoints hold one tensor and a load fills both copies), and after each
backward the two copies' gradients are summed over the "embedding group" of the first and last
pp ranks (`Pipeline.sync_tied_gradients`): both take the same update and stay bit-identical. The
gradient norm counts the matrix once (the last stage's copy is left out of it:
`optim.clipping.mark_counted_elsewhere`).

Bubble: with p stages per pipeline and m microbatches, GPipe and 1F1B idle for a fraction
(p − 1)/(m + p − 1) of the step, i.e. (p − 1)/m of the useful time (Narayanan et al. 2021, §2.2);
interleaving v stages per rank divides it by v.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from densetrain.errors import UserError
from densetrain.models.loss import LossOutput
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.layout_check import (
    balanced_split,
    degrees_layout,
    layer_split_reasons,
    layout_on_mesh,
    require,
)
from densetrain.parallel.mesh import ParallelMesh

_SINGLE_STAGE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
_MULTI_STAGE = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def layer_split(num_layers: int, num_stages: int, given: list[int]) -> list[int]:
    """Layers per stage: ``given`` (checked) or as balanced as possible
    (`layout_check.balanced_split`: a remainder goes to the middle stages, never the first)."""
    problems = layer_split_reasons(given, num_stages, num_layers)
    if problems:
        raise UserError(problems[0])
    if given:
        return list(given)
    require(("pp_stages_have_layers",), degrees_layout(pp=num_stages),
            SimpleNamespace(num_layers=num_layers))
    return balanced_split(num_layers, num_stages)


def stage_ids_for_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Which stages rank ``pp_rank`` holds (loop order, or V shape for "zbv")."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


def split_stage(model: nn.Module, stage: int, sizes: list[int]) -> nn.Module:
    """Keep in ``model`` (in place) only what stage ``stage`` of ``sizes`` runs.

    Stages after the first take hidden states (``embeds_tokens`` False) and drop the embedding
    side (token and position embeddings, projection, embedding norm); stages before the last
    drop the final norm, projection and head. The last stage of a tied model keeps
    ``tok_embeddings`` as its head's weight (`Transformer.output_weight`)."""
    start = sum(sizes[:stage])
    keep = {str(i) for i in range(start, start + sizes[stage])}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    last = len(sizes) - 1
    if stage != 0:
        model.embeds_tokens = False
        if not (stage == last and model.config.tie_embeddings):
            model.tok_embeddings = None
        # Left in place these would be parameters no stage trains, saved beside the first
        # stage's trained ones under the same names.
        model.project_in = model.pos_embeddings = model.embed_norm = None
    if stage != last:
        model.norm = None
        model.output = None
        model.project_out = None
    return model


def tied_embedding_group(pmesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The process group of the pp ranks holding the first and the last stage (pp ranks 0 and
    pp − 1) at this rank's other mesh coordinates; with pp = 2 the pp group itself. Every rank
    must call it (new groups are made by all ranks, in one order)."""
    pp = pmesh.dims.pp
    if pp == 2:
        return pmesh.group("pp")
    mesh = pmesh.device_mesh
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, pp)
    pairs = [[int(row[0]), int(row[-1])] for row in ranks]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


@dataclass
class Pipeline:
    """The schedule of this rank and the stage modules it holds (to build the optimizer over)."""

    schedule: object
    modules: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    num_microbatches: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    loss_chunk_size: int | None = None
    tied_weights: list[torch.Tensor] = field(default_factory=list)
    """This rank's copies of a tied embedding matrix (first stage's, last stage's), if any."""
    tied_group: dist.ProcessGroup | None = None
    """The embedding group (`tied_embedding_group`) over which their gradients are summed."""

    @property
    def duplicate_names(self) -> list[str]:
        """Names of this rank's state that another pp rank also holds: the last stage's copy of
        a tied embedding on a rank without the first stage (equal to the first stage's)."""
        if self.tied_weights and not self.has_first_stage:
            return ["tok_embeddings.weight"]
        return []

    @property
    def has_first_stage(self) -> bool:
        """This rank feeds tokens in."""
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        """This rank computes the loss."""
        return self.num_stages - 1 in self.stage_ids

    def _inputs(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[tuple, dict]:
        """The schedule's arguments: tokens for the first stage; for the last, the targets as
        keywords of its forward (torch splits keyword tensors into microbatches and hands them
        to every stage of the rank; stages without the head ignore them), so that the stage
        returns its loss (`Transformer.forward`) rather than full-vocabulary logits."""
        args = (tokens,) if self.has_first_stage else ()
        if not self.has_last_stage:
            return args, {}
        return args, {"target": targets, "targets_BS": targets,
                      "loss_chunk_size": self.loss_chunk_size}

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; returns the mean loss on the last-stage rank."""
        losses: list[torch.Tensor] = []
        args, kwargs = self._inputs(tokens, targets)
        self.schedule.step(*args, losses=losses, return_outputs=False, **kwargs)
        self.sync_tied_gradients()
        return torch.stack(losses).mean() if self.has_last_stage else None

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Sum the gradients of the tied embedding's two copies over the embedding group, so
        that each holds the full gradient of the one shared matrix (its use as the input
        embedding plus its use as the head). The copies are sharded alike (the same FSDP/TP
        layout on both stages), so once each gradient has its weight's layout the local shards
        add element by element."""
        from torch.distributed.tensor import DTensor

        for weight in self.tied_weights:
            if weight.grad is None:  # the other rank still waits for this one's part
                weight.grad = torch.zeros_like(weight)
            grad = weight.grad
            if isinstance(grad, DTensor) and grad.placements != weight.placements:
                # The vocab-parallel embedding's backward leaves a replicated gradient where
                # the head's is sharded by rows like the weight: slice it (no communication).
                grad = grad.redistribute(weight.device_mesh, weight.placements)
                weight.grad = grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad,
                            group=self.tied_group)

    def eval(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only (the schedule's ``eval``); the mean loss on the last-stage rank."""
        losses: list[torch.Tensor] = []
        args, kwargs = self._inputs(tokens, targets)
        self.schedule.eval(*args, losses=losses, return_outputs=False, **kwargs)
        return torch.stack(losses).mean().detach() if self.has_last_stage else None


class PipelinedModel(nn.Module):
    """This rank's pipeline stage modules as one module named like the full `Transformer`.

    Not callable: the pipeline schedule runs the stages. The children are the stages' own
    modules (shared, not copied), so optimizers, ``state_dict`` and DCP see the real (possibly
    FSDP-sharded) parameters under the full model's names (the split keeps layer keys
    ``layers.<i>`` and the embedding/head names), so checkpoints of a pipelined run hold the same
    names as any other layout and DCP reshards them.
    """

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in pipeline.modules:
            for name, child in stage.named_children():
                if name == "layers":
                    for key, layer in child.items():
                        self.layers[key] = layer
                elif child is not None and getattr(self, name, None) is None:
                    setattr(self, name, child)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        """Not supported: a pipelined model runs through its pipeline schedule."""
        raise RuntimeError("a pipelined model runs through its pipeline schedule")


def stage_loss(output: tuple[torch.Tensor, ...], targets_BS: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: the last stage's forward already computed the loss
    against ``targets_BS`` (passed to it as a keyword, `Pipeline.step`), so pick it out of
    the stage's output (a `LossOutput` as a plain tuple, `_plain_tuple_output`)."""
    del targets_BS
    return LossOutput(*output).loss


def _plain_tuple_output(module: nn.Module, args: object, output: object) -> object:
    """Forward hook of the last stage: torch's stage takes a tuple output only when its type is
    exactly ``tuple`` (a NamedTuple would be wrapped whole as one output), so hand the
    `LossOutput` on as a plain tuple of its tensors."""
    del module, args
    return tuple(output) if isinstance(output, LossOutput) else output


def build_pipeline(
    model_factory: Callable[[], nn.Module],
    pmesh: ParallelMesh,
    cfg: ParallelConfig,
    *,
    num_layers: int,
    microbatches: int,
    init_seed: int,
    device: torch.device,
    materialize: Callable[[], AbstractContextManager] = nullcontext,
    loss_chunk_size: int | None = None,
    gather_dtype: torch.dtype | None = None,
) -> Pipeline:
    """Build this rank's stages and the schedule over ``microbatches`` per step
    (`build.pipeline_microbatches`). ``model_factory`` returns the whole model on
    the meta device; each stage keeps its ``num_layers`` share, is parallelized, and only then
    materialised on ``device`` and initialised (inside ``materialize()``: `build_model`), so a
    rank allocates its own stages alone. The stages, schedule and layer split are those of the
    run's layout (``pmesh.layout``, checked where the run was built); a mesh without one (a
    direct call) is laid out as its degrees with ``cfg``'s options, and its tied-embedding rule
    checked here."""
    from densetrain.parallel.parallelize import init_weights, parallelize

    checked = pmesh.layout is not None
    layout = pmesh.layout if checked else layout_on_mesh(pmesh.dims, cfg)
    pp_mesh = pmesh.submesh("pp")
    num_stages = layout.num_stages
    sizes = layer_split(num_layers, num_stages, list(layout.pp_layer_split))
    pp_rank = pp_mesh.get_local_rank()
    stage_ids = stage_ids_for_rank(pp_rank, layout.pp, layout.pp_virtual_stages,
                                   layout.pp_schedule)
    from densetrain.optim.clipping import mark_counted_elsewhere

    modules, tied_weights = [], []
    for stage_id in stage_ids:
        module = model_factory()
        tied = bool(module.config.tie_embeddings)
        if not checked:
            require(("pp_tied_without_zbv",), layout, module.config)
        module = split_stage(module, stage_id, sizes)
        module = parallelize(module, pmesh, cfg, gather_dtype=gather_dtype)
        if stage_id == num_stages - 1:
            module.register_forward_hook(_plain_tuple_output)
        with materialize():
            module.to_empty(device=device)
            init_weights(module, init_seed)
        if tied and stage_id in (0, num_stages - 1):
            weight = module.tok_embeddings.weight
            tied_weights.append(weight)
            if stage_id != 0:
                mark_counted_elsewhere(weight)
        modules.append(module)
    tied_group = tied_embedding_group(pmesh) if modules[0].config.tie_embeddings else None
    schedule = make_schedule(modules, stage_ids, num_stages, pmesh, cfg, stage_loss,
                             microbatches=microbatches, device=device)
    return Pipeline(schedule=schedule, modules=modules, stage_ids=stage_ids, num_stages=num_stages,
                    num_microbatches=microbatches, loss_fn=stage_loss,
                    loss_chunk_size=loss_chunk_size, tied_weights=tied_weights,
                    tied_group=tied_group)


def make_schedule(modules: list[nn.Module], stage_ids: list[int], num_stages: int,
                  pmesh: ParallelMesh, cfg: ParallelConfig,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                  microbatches: int, device: torch.device,
                  stage_io: Callable[[int, nn.Module], tuple] | None = None) -> object:
    """The schedule of ``cfg.pp_schedule`` over this rank's stage ``modules``.

    ``stage_io(stage_id, module)``, when given, returns the stage's ``(input_args,
    output_args)`` (tensors of the shapes and dtypes one microbatch passes): torch then skips the
    shape exchange with the neighbouring stages at the first step (a dry run has no
    neighbours to answer it)."""
    import torch.distributed.pipelining as pipelining

    group = pmesh.submesh("pp").get_group()
    stages = []
    for stage_id, module in zip(stage_ids, modules, strict=True):
        io = stage_io(stage_id, module) if stage_io is not None else (None, None)
        stages.append(_lean_stage_class()(
            module, stage_id, num_stages, device, group=group, input_args=io[0],
            output_args=io[1], reduce_every_microbatch=cfg.pp_grad_reduce == "microbatch"))
    if cfg.pp_schedule in _SINGLE_STAGE:
        cls = getattr(pipelining, _SINGLE_STAGE[cfg.pp_schedule])
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    cls = getattr(pipelining, _MULTI_STAGE[cfg.pp_schedule])
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)


@functools.cache
def _lean_stage_class():
    """`PipelineStage` whose receive buffers live per transfer (made once, on first use: the
    pipelining import stays out of the module's)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining._backward import stage_backward
    from torch.distributed.pipelining.stage import PipelineStage, _make_tensor_from_meta

    class LeanPipelineStage(PipelineStage):
        """torch's `PipelineStage` with receive buffers allocated per transfer.

        torch makes, at the first step, one activation and one gradient receive buffer per
        microbatch of the step and keeps them for the schedule's life: m whole-sequence
        buffers of the residual stream each (8 GiB on the Llama 3 405B first stage, 30 GiB
        on Korthikanti et al.'s 175B first stage). Here a buffer is made just before its
        receive (from the metadata torch keeps beside it) and dropped once that microbatch's
        backward has run (its forward, for a stage without backward): a stage holds the
        buffers of its in-flight microbatches only, as Megatron-LM does. Dropping a reference
        never frees memory that is still read: autograd and in-flight sends hold their own.
        Written here because torch's stage has no option for it; it overrides the private
        `_get_recv_ops` and the infrastructure setters (checked by
        tests/unit/parallel/test_pipeline_buffers.py).

        A stage's output is freed once its send is issued (`get_fwd_send_ops`): torch keeps it
        until the microbatch's backward, which needs only its autograd node (Megatron-LM's
        ``deallocate_output_tensor``; 3.5 GiB on the second stage of the Llama 3 405B layout).

        ``reduce_every_microbatch`` (``parallel.pp_grad_reduce = "microbatch"``): an FSDP stage
        reduce-scatters its gradients after every microbatch's full backward, keeping its
        parameters gathered (torch's stage defers the reduction to the step's end and holds
        the stage's whole gradients unsharded until then)."""

        def __init__(self, *args, reduce_every_microbatch: bool = False, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.reduce_every_microbatch = reduce_every_microbatch

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                       last_backward: bool = False):
            if not (self.reduce_every_microbatch and backward_type == "full"
                    and isinstance(self.submod, FSDPModule)):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                          last_backward=last_backward)
            # every backward is a "last" one for FSDP: it reduce-scatters into the sharded
            # gradients (which accumulate) and waits for the reduction before the next
            self.submod.set_is_last_backward(True)
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                   bwd_kwargs["input_values"])
            return grads, None

        def _released(self) -> set[int]:
            if not hasattr(self, "_released_infos"):
                self._released_infos: set[int] = set()
            return self._released_infos

        def _release(self, infos) -> None:
            released = self._released()
            for info in infos or ():
                if not info.is_root_arg and info.buffer is not None:
                    info.buffer = None
                    released.add(id(info))

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            super()._setup_forward_recv_info(num_microbatches, has_backward)
            for infos in self.args_recv_info.values():
                self._release(infos)

        def _create_grad_recv_info(self, act_send_info: dict):
            infos = super()._create_grad_recv_info(act_send_info)
            self._release(infos)
            return infos

        def _get_recv_ops(self, recv_infos):
            released = self._released()
            for info in recv_infos:
                if id(info) in released:
                    released.discard(id(info))
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
            return super()._get_recv_ops(recv_infos)

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            # The stage's output is kept (in ``fwd_cache``) until its backward, which reads
            # only its autograd node, not its values; the send ops carry a detached alias of
            # the storage, which the transfer keeps alive until it completes. Megatron-LM
            # frees the output's data once sent (``deallocate_output_tensor``): here its data
            # becomes a same-shape zero-stride view of one element, so that the backward's
            # shape checks still hold (a tensor another reference still reads is not
            # affected: only this one's storage pointer changes).
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            output_tuple, _ = self.fwd_cache[fwd_chunk_id]
            for index, out in enumerate(output_tuple):
                if any(dst is not None for dst in self.act_send_info[index]):
                    for tensor in _releasable(out):
                        tensor.data = torch.empty(
                            (), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
            return ops

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            if not self.has_backward:
                self._release(self.args_recv_info.get(fwd_chunk_id))
            return output

        def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
            result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            self._release(self.args_recv_info.get(bwd_chunk_id))
            self._release(self.grad_recv_info.get(bwd_chunk_id))
            return result

    return LeanPipelineStage


def _releasable(tensor) -> list[torch.Tensor]:
    """The tensors whose storage pointer to drop to release a sent stage output: a plain
    tensor (not a DTensor) that autograd produced, with, when it is a view (a
    sequence-parallel stage's gathered output is a view of its gather buffer,
    `parallel.tensor._GatherSequence`), the base it covers whole, if that base is outside
    autograd (so no backward saved it). Empty when the output does not qualify: it is then
    kept."""
    from torch.distributed.tensor import DTensor

    if (not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor)
            or tensor.grad_fn is None):
        return []
    if not tensor._is_view():
        return [tensor]
    base = tensor._base
    if (base is None or base.requires_grad or base._is_view() or base.numel() != tensor.numel()
            or tensor.storage_offset() != 0 or isinstance(base, DTensor)):
        return []
    return [tensor, base]


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a GPipe/1F1B step, (p − 1)/(v·m + p − 1) (Narayanan et al. 2021 §2.2)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def bubble_ratio(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble time over ideal compute time, (p − 1)/(v·m) (Narayanan et al. 2021 §2.2)."""
    return (pp - 1) / (virtual_stages * microbatches)
