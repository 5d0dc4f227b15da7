"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) and sequence parallel (Korthikanti et al.
2022) through DTensor plans over the model's parameter names (models/transformer.py).

Per block: ``wq/wk/wv`` and ``w_up/w_gate`` are split by output features (column-wise),
``wo`` and ``w_down`` by input features (row-wise), so each block needs one all-reduce forward
and one backward. With sequence parallel the norms (and dropout) run on a 1/tp slice of the
sequence and that all-reduce becomes a reduce-scatter plus an all-gather. The token embedding is
vocab-parallel (row-wise over the padded vocab, which need not divide by tp: DTensor shards it
unevenly) and the output projection is column-wise over the vocab. With tied embeddings
(GPT-2/GPT-3) the head has no weight of its own: the logits use the token embedding, whose
vocab-parallel [P, E] shard (Shard(0)) is exactly the column-wise head's, so the one DTensor
serves both and receives both gradients. Learned absolute positions (``pos_embeddings``) are
replicated over tp; with sequence parallel each rank adds only its sequence slice of them (the
gradient is gathered back to the whole table). The model's ``loss_head`` is set to a
vocab-parallel cross-entropy of each rank's logit slice (``parallel/loss.py``), fused with the
projection and chunked over the tokens when the job sets ``loss_chunk_size``; ``forward``
without targets returns the gathered logits.

GQA: kv heads are split across tp ranks when tp divides them. With fewer kv heads than tp ranks
(kv dividing tp; MQA is kv = 1), the kv projections are replicated on every rank and each rank
keeps the output of the one kv head its query heads use (rank r: head r // (tp / kv)); the
weight gradient is summed over tp. Each attention module's head counts are set to the local
ones, so the model code reshapes with the local sizes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from densetrain.models.transformer import TiedOutput
from densetrain.parallel.layout_check import ResolvedLayout


def _attention_plan(attn: nn.Module, tp: int, sequence_parallel: bool, kv_ways: int) -> dict:
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    kv_sharded = kv_ways == tp  # the layout's `kv_split`: else tp is a multiple of the kv heads
    for name in ("attn.wk", "attn.wv"):
        plan[name] = (
            ColwiseParallel() if kv_sharded else _ReplicatedKV(attn.num_kv_heads, attn.head_dim, tp)
        )
    return plan


class _ReplicatedKV(ColwiseParallel):
    """A kv projection kept whole on every tp rank (fewer kv heads than tp ranks).

    Its weight is a Replicate DTensor. Each rank keeps only the output columns of the kv head
    its local query heads attend with, and marks the gradient Partial so that the weight
    gradient (zero outside a rank's head) is summed over the tp ranks.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, tp: int) -> None:
        super().__init__()
        self.num_kv_heads, self.head_dim, self.tp = num_kv_heads, head_dim, tp

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters()):
            replicated = nn.Parameter(
                DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
            )
            module.register_parameter(pname, replicated)
        head = device_mesh.get_local_rank() // (self.tp // self.num_kv_heads)
        module._kv_columns = (head * self.head_dim, (head + 1) * self.head_dim)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if isinstance(outputs, DTensor):
            outputs = outputs.to_local(grad_placements=[Partial()])
        start, end = mod._kv_columns
        return outputs[..., start:end]


def _distribute_parameters(module: nn.Module, mesh, placement) -> None:
    """Make ``module``'s own parameters DTensors over ``mesh`` in ``placement`` (those that are
    not yet): Replicate from each rank's local values (every rank holds the same, not yet
    initialised ones: no broadcast), Shard by `distribute_tensor`."""
    for name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        if isinstance(placement, Replicate):
            data = DTensor.from_local(param.data, mesh, [placement], run_check=False)
        else:
            data = distribute_tensor(param.data, mesh, [placement])
        module.register_parameter(name, nn.Parameter(data, requires_grad=param.requires_grad))


class _ReplicatedPositions(ParallelStyle):
    """The learned position table [rows, D], replicated on every tp rank.

    The positions come in whole (Replicate) and the embedding output leaves as a plain tensor
    in the residual stream's layout: whole without sequence parallel, this rank's slice of the
    sequence (Shard(1)) with it. Slicing a Replicate DTensor is local; its backward gathers
    the slices' gradients, so every rank computes the same, full gradient of the table.
    """

    def __init__(self, output_layout) -> None:
        super().__init__()
        self.output_layout = output_layout

    @staticmethod
    def _partition(name, module, mesh):
        _distribute_parameters(module, mesh, Replicate())

    @staticmethod
    def _prepare_input(mod, inputs, mesh):
        positions = inputs[0]
        if not isinstance(positions, DTensor):
            positions = DTensor.from_local(positions, mesh, [Replicate()], run_check=False)
        return (positions, *inputs[1:])

    def _prepare_output(self, mod, outputs, mesh):
        if outputs.placements != (self.output_layout,):
            outputs = outputs.redistribute(mesh, [self.output_layout])
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition,
            input_fn=self._prepare_input,
            output_fn=lambda mod, outputs, mesh: self._prepare_output(mod, outputs, mesh),
        )


class _VocabParallelEmbedding(ParallelStyle):
    """The token embedding split over the padded vocabulary (Shard(0), uneven when tp does not
    divide it), looked up as Megatron-LM does: each rank embeds the tokens in its rows (the
    others give zeros) and the partial sums are reduced into the residual stream's layout (a
    reduce-scatter over the sequence under sequence parallelism, an all-reduce without).

    Written here rather than left to DTensor's embedding rules: those give the weight's
    gradient as a whole-vocabulary partial sum on every tp rank, reduce-scattered afterwards
    (7.8 GiB in fp32 per rank at Llama 3 405B's vocabulary, plus a bf16 copy); here backward
    gathers the [B, S, E] output gradient and each rank computes its own rows' gradient only."""

    def __init__(self, output_layout) -> None:
        super().__init__()
        self.output_layout = output_layout

    @staticmethod
    def _partition(name, module, mesh):
        _distribute_parameters(module, mesh, Shard(0))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = distribute_module(module, device_mesh, self._partition)
        module.lookup = functools.partial(vocab_parallel_lookup, output_layout=self.output_layout)
        return module


def vocab_parallel_lookup(tokens_BS: torch.Tensor, weight: DTensor, *, output_layout
                          ) -> torch.Tensor:
    """The embeddings of ``tokens_BS`` (whole on every tp rank) from the vocab-parallel
    ``weight`` (Shard(0) over the tp mesh), as a plain tensor in ``output_layout`` (this rank's
    sequence slice under Shard(1), the whole [B, S, E] under Replicate)."""
    mesh = weight.device_mesh
    (placement,) = weight.placements
    rows, first = placement.local_shard_size_and_offset(weight.shape[0], mesh.size(),
                                                        mesh.get_local_rank())
    outside_BS = (tokens_BS < first) | (tokens_BS >= first + rows)
    local_BS = (tokens_BS - first).masked_fill(outside_BS, 0)
    rows_BSE = F.embedding(local_BS, weight.to_local())
    rows_BSE = rows_BSE.masked_fill(outside_BS.unsqueeze(-1), 0)
    partial = DTensor.from_local(rows_BSE, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [output_layout]).to_local()


class _TiedVocabParallelHead(ParallelStyle):
    """The head of a tied model (`TiedOutput`): its weight is the token embedding, already
    vocab-parallel (Shard(0), the layout of a column-wise head), so only the optional
    ``lm_head_bias`` [P] is sharded here, over the vocab like the weight's rows."""

    @staticmethod
    def _partition(name, module, mesh):
        _distribute_parameters(module, mesh, Shard(0))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition)


def _block_plan(block: nn.Module, tp: int, sequence_parallel: bool, kv_ways: int) -> dict:
    seq_layout = Shard(1) if sequence_parallel else Replicate()
    plan = _attention_plan(block.attn, tp, sequence_parallel, kv_ways)
    plan["mlp.w_up"] = ColwiseParallel()
    plan["mlp.w_down"] = RowwiseParallel(output_layouts=seq_layout)
    if getattr(block.mlp, "w_gate", None) is not None:
        plan["mlp.w_gate"] = ColwiseParallel()
    if block.attn.q_norm is not None:
        # QK-norm (Qwen3): per-head norms on the rank's own heads [B, S, H/tp, K], the heads
        # dimension sharded; the weight [K] is replicated and its gradient a partial sum over
        # the tp ranks' heads, which DTensor reduces as for a sequence-parallel norm
        for name in ("attn.q_norm", "attn.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if block.attn.relative is not None:
        # Transformer-XL relative positions split with the heads: W_R column-wise (each rank
        # projects the sinusoids to its own heads' position keys), u and v by head
        plan["attn.relative.pos_proj"] = ColwiseParallel()
        plan["attn.relative.content_bias"] = _HeadShardedVector()
        plan["attn.relative.position_bias"] = _HeadShardedVector()
    shared_input = block.parallel and block.mlp_norm is None
    if shared_input:
        # One norm feeds both branches (PaLM, phi-1): its output leaves as one Replicate
        # DTensor, gathered once from the sequence shards under sequence parallel; both
        # branches read it, so backward sums their input gradients before the one reduction
        # (reduce-scatter, or all-reduce without sequence parallel).
        branch_input = Replicate()
        plan["attn_norm"] = _GatheredOutput(sequence_parallel)
    else:
        branch_input = seq_layout
        if sequence_parallel:
            plan["attn_norm"] = SequenceParallel(use_local_output=True)
            if block.mlp_norm is not None:
                plan["mlp_norm"] = SequenceParallel(use_local_output=True)
    for name in ("attn", "mlp"):
        plan[name] = PrepareModuleInput(input_layouts=(branch_input,),
                                        desired_input_layouts=(Replicate(),),
                                        use_local_output=False)
    if block.parallel and not block.dropout:
        # Parallel blocks (GPT-J, GPT-NeoX, PaLM): the two branches' partial sums are added
        # first and reduced together, one reduce-scatter (or all-reduce) per block instead of
        # two. With dropout each branch is dropped on its own, after its own reduction.
        for name in ("attn.wo", "mlp.w_down"):
            plan[name] = RowwiseParallel(output_layouts=Partial(), use_local_output=False)
        block.join_branches = functools.partial(_join_partial_branches, layout=seq_layout)
    return plan


class _HeadShardedVector(ParallelStyle):
    """A per-head vector [H·K] (`models.relative.HeadBias`: Transformer-XL's u and v) split with
    the heads, Shard(0) over tp; the module returns this rank's slice, whose gradient is the
    shard's own."""

    @staticmethod
    def _partition(name, module, mesh):
        _distribute_parameters(module, mesh, Shard(0))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 output_fn=lambda mod, output, mesh: output.to_local())


class _ReplicatedOnStream(ParallelStyle):
    """A module of the residual stream (an embedding projection) with its parameters replicated
    over tp (Replicate DTensors: under sequence parallel their gradients are partial sums over
    the sequence shards, reduced by DTensor) and its input taken in ``layout`` (a plain tensor
    as this rank's part); its output a DTensor, or this rank's plain part."""

    def __init__(self, layout, *, use_local_output: bool) -> None:
        super().__init__()
        self.layout, self.use_local_output = layout, use_local_output

    @staticmethod
    def _partition(name, module, mesh):
        _distribute_parameters(module, mesh, Replicate())

    def _prepare_input(self, mod, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.layout], run_check=False)
        elif x.placements != (self.layout,):
            x = x.redistribute(mesh, [self.layout])
        return (x, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition,
            input_fn=lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            output_fn=lambda mod, out, mesh: out.to_local() if self.use_local_output else out)


class _GatheredOutput(ParallelStyle):
    """A norm whose output leaves as one Replicate DTensor: run on the sequence shard and
    all-gathered under sequence parallel (torch's ``SequenceParallel`` for the parameters and
    input), else run whole on every rank with plain parameters. The branches reading it then
    share one gradient, reduced once."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.sequence_parallel:
            module = SequenceParallel(use_local_output=False)._apply(module, device_mesh)

        def gathered(mod, inputs, output):
            if isinstance(output, DTensor):
                return output.redistribute(device_mesh, [Replicate()])
            return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)

        module.register_forward_hook(gathered)
        return module


def _join_partial_branches(x_BSD: torch.Tensor, attn_BSD: DTensor, mlp_BSD: DTensor, *,
                           layout) -> torch.Tensor:
    """A tensor-parallel parallel block's `JoinBranches`: the branches' partial sums (Partial
    DTensors) added, reduced once into the residual stream's ``layout`` and added to it."""
    both = attn_BSD + mlp_BSD
    return x_BSD + both.redistribute(both.device_mesh, [layout]).to_local()


def apply_tensor_parallel(model: nn.Module, tp_mesh, *, sequence_parallel: bool,
                          layout: ResolvedLayout | None = None) -> nn.Module:
    """Shard ``model`` (a ``Transformer`` or a pipeline stage of one) over the 1-D ``tp_mesh``.

    Works in place: parameters become DTensors over ``tp_mesh`` and attention head counts become
    the local ones. The model's output (logits, or hidden states of a non-last pipeline stage)
    is returned as a plain, full tensor on every tp rank. ``layout``: the run's checked layout
    (``ParallelMesh.layout``); without one (a direct call) the tensor-parallel rules are checked
    here on the layout of ``tp_mesh`` alone.
    """
    from densetrain.parallel.layout_check import degrees_layout, require

    tp = tp_mesh.size()
    if layout is None:
        # A direct caller (not through a checked run layout) gets the same refusal as a config.
        layout = degrees_layout(model.config, tp=tp)
        require(("tp_divides_heads", "tp_and_kv_heads", "tp_divides_ffn"),
                layout, model.config)
    seq_layout = Shard(1) if sequence_parallel else Replicate()
    top_plan: dict = {}
    if model.tok_embeddings is not None:
        # With tied embeddings this weight is also the output head's (`Transformer.output_weight`);
        # the last pipeline stage of a tied model holds it for the head only (never called), in
        # the same vocab-parallel layout as the first stage's copy.
        top_plan["tok_embeddings"] = _VocabParallelEmbedding(seq_layout)
        if getattr(model, "pos_embeddings", None) is not None:
            top_plan["pos_embeddings"] = _ReplicatedPositions(seq_layout)
        if getattr(model, "embed_norm", None) is not None and sequence_parallel:
            # BLOOM's embedding LayerNorm, on the sequence shard like the blocks' norms
            top_plan["embed_norm"] = SequenceParallel(use_local_output=True)
        if getattr(model, "project_in", None) is not None:
            # OPT-350m's embedding projection E -> D, replicated, on the residual's layout
            top_plan["project_in"] = _ReplicatedOnStream(seq_layout, use_local_output=True)
    if model.output is not None:
        # ``Transformer.logits`` applies the head with F.linear on ``output_weight()``, so only
        # the weight layout matters here; the final norm, the projection after it or the last
        # block hands it a DTensor.
        if model.norm is not None:
            top_plan["norm"] = (
                SequenceParallel(use_local_output=False)
                if sequence_parallel
                else PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=Replicate(),
                    use_local_output=False,
                )
            )
        if getattr(model, "project_out", None) is not None:
            top_plan["project_out"] = _ReplicatedOnStream(seq_layout, use_local_output=False)
        elif model.norm is None and len(model.layers):
            # no final norm (OPT-350m): the last block's output is the head's input
            last = list(model.layers.values())[-1]
            last.register_forward_hook(
                lambda mod, args, out: DTensor.from_local(out, tp_mesh, [seq_layout],
                                                          run_check=False))
        if isinstance(model.output, TiedOutput):
            # tied: the head's weight is the token embedding, sharded above (same DTensor)
            top_plan["output"] = _TiedVocabParallelHead()
        else:
            top_plan["output"] = ColwiseParallel(input_layouts=seq_layout, use_local_output=False)
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, tp, sequence_parallel,
                                                       layout.kv_split))
        attn = block.attn
        attn.num_heads //= tp
        attn.num_kv_heads = max(attn.num_kv_heads // tp, 1)
        # wq's column-wise split gives rank r the r-th block of heads: a per-head mask (ALiBi)
        # is sliced to them
        attn.head_start = tp_mesh.get_local_rank() * attn.num_heads
        if attn.relative is not None:
            attn.relative.num_heads //= tp
    _add_stage_io_hooks(model, tp_mesh, sequence_parallel)
    if model.output is not None:
        model.loss_head = vocab_parallel_loss_head
    return model


def vocab_parallel_loss_head(
    model: nn.Module, hidden: DTensor, targets_BS: torch.Tensor, *, chunk_size: int | None = None
):
    """The model's ``loss_head`` under tensor parallel: vocab-parallel cross-entropy over the
    local logit slice [N, L] of each tp rank (L = P / tp rows of the head).

    With ``chunk_size`` (a positive number of tokens) the local projection and the loss are
    fused and run ``chunk_size`` tokens at a time (`vocab_parallel_chunked_loss`), so a rank
    peaks at [chunk_size, L] logits instead of [N, L] (at 8,192 tokens and a 128,256 vocab on
    tp 8, the unchunked loss holds several [N, L] fp32 buffers, ~0.5 GiB each); None or 0
    computes the whole slice's logits at once."""

    from densetrain.parallel.loss import vocab_parallel_chunked_loss, vocab_parallel_cross_entropy

    weight = model.output_weight()  # the token embedding when tied: the same Shard(0) DTensor
    mesh = weight.device_mesh
    # Each rank's logits use only its rows of the head: the hidden gradient is a partial sum.
    hidden_BSE = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    weight_LE = weight.to_local()
    bias_L = model.output.bias.to_local() if model.output.bias is not None else None
    # The head is Shard(0) over the tp mesh: its first row, from ints alone (no tensor op, so
    # it runs under a dry run's fake tensors too).
    (placement,) = weight.placements
    _, first_row = placement.local_shard_size_and_offset(weight.shape[0], mesh.size(),
                                                         mesh.get_local_rank())
    cfg = model.config
    common = dict(vocab_offset=first_row, vocab_size=cfg.vocab_size, group=mesh.get_group(),
                  ignore_index=cfg.ignore_index, z_loss_coef=cfg.z_loss_coef)
    if chunk_size:
        return vocab_parallel_chunked_loss(
            hidden_BSE.reshape(-1, hidden_BSE.shape[-1]), weight_LE, targets_BS.reshape(-1),
            chunk_size=chunk_size, bias_L=bias_L, **common,
        )
    logits_BSL = F.linear(hidden_BSE, weight_LE, bias_L)
    return vocab_parallel_cross_entropy(
        logits_BSL.reshape(-1, logits_BSL.shape[-1]), targets_BS.reshape(-1), **common
    )


def _add_stage_io_hooks(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Make the model's inputs and outputs plain full tensors on every tp rank.

    A pipeline stage after the first receives full hidden states; with sequence
    parallel the residual stream is sharded over the sequence, so the input is sliced at the
    first block (the stage computes positions from the full input). Outputs that are DTensors
    (logits) or sequence shards (hidden states of a non-last stage) are gathered.
    """

    def slice_input(module, args, kwargs):
        full = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        return (full.redistribute(tp_mesh, [Shard(1)]).to_local(), *args[1:]), kwargs

    def gather_output(module, args, kwargs, output):
        if isinstance(output, DTensor):
            return output.full_tensor()
        if module.output is None and module.norm is None and sequence_parallel:
            return _GatherSequence.apply(output, tp_mesh.get_group())
        return output

    if not model.takes_tokens() and sequence_parallel:
        first_block = next(iter(model.layers.values()))
        first_block.register_forward_pre_hook(slice_input, with_kwargs=True)
    model.register_forward_hook(gather_output, with_kwargs=True)


class _GatherSequence(torch.autograd.Function):
    """A non-last pipeline stage's sequence shards [b, s/t, h] gathered into the whole
    sequence [b, s, h] it sends, a tensor of its own; backward takes this rank's slice of the
    gradient (the next stage's input gradient, whole and equal on every tp rank).

    Written out because DTensor's ``full_tensor`` returns a view whose storage other tensors
    of its redistribution keep alive until the microbatch's backward, so the stage could not
    release its output once sent (`parallel.pipeline`), 14 outputs of 256 MiB on the second
    stage of Llama 3 405B in the paper's layout."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ways = dist.get_world_size(group)
        ctx.group, ctx.ways = group, ways
        rows, part = shard.shape[0], shard.shape[1]
        rest = shard.shape[2:]
        gathered = torch.empty((ways * rows, part, *rest), dtype=shard.dtype,
                               device=shard.device)
        dist.all_gather_into_tensor(gathered, shard.contiguous(), group=group)
        if rows == 1:  # [t, s/t, h] is [1, s, h] in memory already: no copy
            return gathered.view(1, ways * part, *rest)
        stacked = gathered.view(ways, rows, part, *rest)
        return stacked.transpose(0, 1).reshape(rows, ways * part, *rest)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        rank = dist.get_rank(ctx.group)
        part = grad.shape[1] // ctx.ways
        return grad.narrow(1, rank * part, part).contiguous(), None


def _register_fused_sharding() -> None:
    """How DTensor shards `densetrain.models.fused.rms_norm` (sequence-parallel norms run it on
    a sequence shard): the input split over any dimension but the normalised last one, the
    output and ``rstd`` split alike, the weight replicated; or everything replicated. Its
    backward is plain ATen ops, which DTensor shards by its own rules (the weight's gradient is
    a partial sum over the sequence shards, as for torch's own norms)."""
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.densetrain.rms_norm.default)
    def _rms_norm_sharding(x, weight, eps):
        weight_spec = None if weight is None else Replicate()
        options = [([Replicate(), Replicate()], [Replicate(), weight_spec, None])]
        for dim in range(x.ndim - 1):
            options.append(([Shard(dim), Shard(dim)], [Shard(dim), weight_spec, None]))
        return options


_register_fused_sharding()
