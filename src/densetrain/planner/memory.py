"""Memory per device: model states by the ZeRO formulas, activations by Korthikanti et al.

Model states (Rajbhandari et al. 2020, "ZeRO", sec. 5.2), for Psi parameters on one device,
parameter/gradient/optimizer bytes (p, g, k) and a shard degree N_d:
stage 0 (plain DP) (p+g+k)Psi; stage 1 (p+g)Psi + k Psi/N_d; stage 2 p Psi + (g+k)Psi/N_d;
stage 3 (p+g+k)Psi/N_d.

Activations per transformer layer and microbatch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4, 16-bit activations, 1-byte dropout masks):
sbh(34 + 5as/h) with no parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism,
sbh/t (34 + 5as/h) with sequence parallelism, and the 5as^2b attention-core term dropped by
selective recompute; full recompute keeps only the layer input, 2sbh. ``layer_activation_bytes``
generalises the term list to GQA (q/kv widths), SwiGLU, any ffn width, no dropout and
FlashAttention, and reduces to those formulas for a GPT layer (tested). Transformer-XL relative
positions add the s x T position scores and the inputs of the position matmul
(``_relative_position_bytes``; measured against autograd in test_planner_relative.py).
"""

from __future__ import annotations

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.parallel.layout_check import kv_split
from densetrain.planner.layout import AC_POLICIES, PP_SCHEDULES, LayoutColumns, PlanSettings
from densetrain.planner.params import sharded_params

AC_NONE, AC_SELECTIVE, AC_FULL = (AC_POLICIES.index(p) for p in ("none", "selective", "full"))
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZBV = (
    PP_SCHEDULES.index(s) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"))


def zero_model_state_bytes(num_params, shard, stage, param_bytes, grad_bytes, optim_bytes):
    """Bytes of (params, grads, optimizer states) on one device for a ZeRO ``stage`` (0-3).

    Works elementwise on numpy arrays. ``num_params`` is Psi on this device after tensor and
    pipeline splits; ``shard`` is the ZeRO shard degree N_d.
    """
    num_params = np.asarray(num_params, dtype=np.float64)
    shard = np.asarray(shard, dtype=np.float64)
    stage = np.asarray(stage)
    params = num_params * param_bytes / np.where(stage >= 3, shard, 1.0)
    grads = num_params * grad_bytes / np.where(stage >= 2, shard, 1.0)
    optim = num_params * optim_bytes / np.where(stage >= 1, shard, 1.0)
    return params, grads, optim


def layer_activation_bytes(cfg: ModelConfig, *, seq_len, micro_batch, tp, sequence_parallel,
                           policy, flash_attention: bool, dropout: bool, activation_bytes=2,
                           selective_keeps_matmul_outputs: bool = False, stream_bytes=None):
    """Activation bytes one transformer layer keeps for backward, per microbatch (elementwise).

    ``seq_len`` is the local sequence (s / cp); ``policy`` an index into ``AC_POLICIES``. The
    ``full`` policy's stored input only; the recompute working set is added by the caller.
    Under sequence parallelism the column-parallel linears keep the sequence shard of their
    input and gather it again in backward (Megatron-LM, Korthikanti et al. 2022 §4.2.2; the
    trainer's block policy, `parallel.checkpointing`). SwiGLU keeps its gate and up projections
    and their product, silu(gate) recomputed in backward (`models.fused.swiglu`).
    ``selective_keeps_matmul_outputs``: the ``selective`` policy as the trainer runs it
    (`selective_matmul_bytes`) instead of Korthikanti et al.'s (recompute the attention core).
    ``stream_bytes``: bytes per element of the residual stream (default ``activation_bytes``).
    """
    s, b, t = (np.asarray(x, dtype=np.float64) for x in (seq_len, micro_batch, tp))
    sp = np.asarray(sequence_parallel, dtype=bool)
    policy = np.asarray(policy)
    e = activation_bytes
    sbh = s * b * cfg.dim
    mask = 1.0 if dropout else 0.0
    # Replicated across tp unless sequence parallel: norm inputs, normed inputs of the qkv and
    # first mlp linears, residual dropout masks. A parallel block's norms both read its input.
    num_norms = 1 if cfg.block_type == "parallel" else 2
    num_linear_inputs = 1 if cfg.parallel_shared_norm else 2
    replicated = sbh * (e * (num_norms + num_linear_inputs) + 2 * mask)
    # Split by tp: q and k (for QK^T), v, the wo input, the mlp activation's inputs/outputs.
    sb = s * b
    kv_ways = kv_split(cfg.num_kv_heads, t)
    sharded = sb * e * (2 * cfg.q_dim) / t + sb * e * 2 * cfg.kv_dim / kv_ways
    # gelu/relu: activation input and output; swiglu: gate, up, and their product.
    mlp_tensors = 3 if cfg.activation == "swiglu" else 2
    sharded = sharded + sb * e * mlp_tensors * cfg.ffn_dim / t
    heads = cfg.num_heads
    if flash_attention:
        core = heads * sb * 4.0 / t  # fp32 log-sum-exp per query and head
    else:
        # softmax output (2as^2b); with dropout also its mask (as^2b) and output (2as^2b).
        core = heads * s * s * b * (e + mask * (1 + e)) / t
        core = np.where(policy == AC_SELECTIVE, 0.0, core)
    if cfg.position_embedding == "relative_xl":
        core = core + _relative_position_bytes(cfg, s, b, t, policy, flash_attention, e)
    stored = np.where(sp, replicated / t, replicated) + sharded + core
    stream = e if stream_bytes is None else stream_bytes
    layer_input = np.where(sp, stream * sbh / t, stream * sbh)
    if selective_keeps_matmul_outputs:
        kept = selective_matmul_bytes(cfg, s=s, b=b, t=t, e=e, kv_ways=kv_ways, sp=sp,
                                      flash_attention=flash_attention)
        stored = np.where(policy == AC_SELECTIVE, layer_input + kept, stored)
    return np.where(policy == AC_FULL, layer_input, stored)


def selective_matmul_bytes(cfg: ModelConfig, *, s, b, t, e, kv_ways, sp=True,
                           flash_attention=True):
    """What the trainer's ``selective`` policy (`parallel.checkpointing`, with its default
    parts: the norms and the MLP activation recomputed) keeps per layer beyond the layer's
    input: q, k and v; the attention output and its fp32 log-sum-exp per query and head; the
    MLP's up (and gate) projections; and the reduced attention output (the MLP norm's input: a
    sequence shard under sequence parallelism; a parallel block's joined reduction feeds only
    the residual add and is not kept). The row-parallel matmuls' own outputs are never kept.
    Without a fused attention kernel the attention scores (a batched matmul's output, s x s per
    head) are kept in place of the log-sum-exp. Traced per layer at real size
    (tests/unit/dryrun/test_layer_memory.py)."""
    sb = s * b
    attention = sb * e * (2 * cfg.q_dim / t + 2 * cfg.kv_dim / kv_ways)
    core = cfg.num_heads * sb * (4.0 if flash_attention else s * e) / t
    attention = attention + core
    up = (2 if cfg.activation == "swiglu" else 1) * sb * e * cfg.ffn_dim / t
    reduced = np.where(sp, sb * e * cfg.dim / t, sb * e * cfg.dim)
    if cfg.block_type == "parallel" and not cfg.dropout:
        reduced = 0.0  # the branches are reduced together, read by the residual add alone
    return attention + up + reduced


def _relative_position_bytes(cfg: ModelConfig, s, b, t, policy, flash_attention: bool, e):
    """What Transformer-XL relative attention (models/relative.py) adds to a layer's stored
    activations, beyond the content attention's q, k, v and output (q + u takes q's place).

    Without recompute: the position matmul's inputs, q + v (s·b·q) and the position keys W_R R
    expanded over the batch by the broadcasting matmul (b·T·q), W_R's input, the T sinusoids
    (T·d), and the boolean causal mask of the ``masked_fill`` (s·T bytes, per layer, not per
    head). The trainer's selective policy keeps matmul outputs only (the position keys, T·q)
    and recomputes the rest. The s x T position scores: a fused SDPA kernel (CUDA's
    memory-efficient one, which takes a float mask with a gradient; the flash kernel takes no
    mask) keeps the bias as an input of its backward
    (``_scaled_dot_product_efficient_attention_backward`` reads ``attn_bias``), e·b·H·s·T; the
    math path adds it to the scores and keeps only the softmax (already counted); the selective
    policy keeps the raw position scores (a bmm output) and recomputes the shift and mask from
    them. T = s: relative_xl runs with cp = 1.
    """
    position_inputs = np.where(
        policy == AC_SELECTIVE, e * s * cfg.q_dim,
        e * (s * b * cfg.q_dim + b * s * cfg.q_dim + s * cfg.dim) + s * s)
    scores = cfg.num_heads * s * s * b * e / t
    if flash_attention:
        return position_inputs / t + scores
    return position_inputs / t + np.where(policy == AC_SELECTIVE, scores, 0.0)


def in_flight_layers(num_layers_stage, pp, schedule, virtual_stages, microbatches, pp_rank=0):
    """Layer-microbatches of activations pipeline rank ``pp_rank`` (default: the first, the
    fullest) holds at its peak.

    1F1B keeps min(pp, m) microbatches of its layers, GPipe all m, interleaved 1F1B
    pp (1 + (pp-1)/(pp v)) (Korthikanti et al. 2022, sec. 4.2.3); without a pipeline, one.
    The interleaved zero-bubble schedule runs interleaved 1F1B's warm-up, so it peaks as it
    does; ZB-V (two stages per rank in a V) peaks as 1F1B does (Qi et al. 2024, "Pipeline
    Parallelism with Controllable Memory", sec. 3: the V shape keeps 1F1B's activation memory).
    """
    pp = np.asarray(pp, dtype=np.float64)
    m = np.asarray(microbatches, dtype=np.float64)
    v = np.asarray(virtual_stages, dtype=np.float64)
    layers = np.asarray(num_layers_stage, dtype=np.float64)
    r = np.asarray(pp_rank, dtype=np.float64)
    one_f = np.minimum(pp - r, m)
    # interleaved: rank r warms up (v - 1) pp + 2 (pp - 1 - r) chunks and holds one more
    factor = np.select(
        [pp == 1, schedule == GPIPE, (schedule == INTERLEAVED) | (schedule == ZERO_BUBBLE)],
        [1.0, m, pp + (pp - 1 - 2 * r) / v],
        default=one_f,
    )
    return layers * factor


def _pipeline_rank_memory(cols: LayoutColumns, settings: PlanSettings, per_layer, stage_layers,
                          microbatches, hidden, *, pp_rank):
    """Activations and pipeline receive buffers (bytes) of pipeline rank ``pp_rank``.

    The trainer's stages make a receive buffer per transfer (`parallel.pipeline`): each
    in-flight chunk of a stage after the first holds the activation it received (its input,
    whole-sequence: the first block keeps a view of it) until its backward, and a stage before
    the last holds the gradient it is receiving (one). torch's own stage keeps one activation
    and one gradient buffer per microbatch of the step (``pp_recv_buffer_per_microbatch``).
    A stage's output is freed once sent (only the send in flight holds one), or with
    ``pp_holds_stage_outputs`` each in-flight chunk's is kept until its backward."""
    v, pp = cols.pp_virtual_stages, cols.pp
    layers_held = in_flight_layers(stage_layers, pp, cols.pp_schedule, v, microbatches,
                                   pp_rank=pp_rank)
    activations = per_layer * layers_held
    piped = pp > 1
    rank = np.broadcast_to(np.asarray(pp_rank), pp.shape)
    first, last = rank == 0, rank == pp - 1
    chunks = layers_held / (stage_layers / v)  # chunks in flight
    holds = piped & ~(last & (v == 1))  # a last stage ends in the loss, not an output
    outputs = chunks if settings.pp_holds_stage_outputs else np.minimum(chunks, 1.0)
    activations = activations + np.where(holds, outputs * hidden, 0.0)
    # per transfer: the received inputs of the in-flight chunks (none on the first stage of a
    # rank without interleaving) and the gradient being received. Megatron-LM's scatter/gather
    # (``pp_scatter_gather``) receives 1/tp and gathers it into the first layer's input, which
    # the per-layer count already holds.
    if settings.pp_scatter_gather:
        inputs, grad = np.zeros(len(cols)), hidden / cols.tp
    else:
        inputs, grad = np.where(first & (v == 1), 0.0, chunks * hidden), hidden
    recv = np.where(piped, inputs + np.where(last & (v == 1), 0.0, grad), 0.0)
    if settings.pp_recv_buffer_per_microbatch:
        # ZB-V: rank 0 holds the first and the last stage (2 buffers), the others 4
        count = np.where(cols.pp_schedule == ZBV, np.where(first, 2, 4),
                         2 * v - first.astype(np.float64) - last.astype(np.float64))
        recv = np.where(piped, microbatches * count * hidden, 0.0)
    return activations, recv


def stage_tables(cfg: ModelConfig, cols: LayoutColumns, pp_rank: int | None = None):
    """Per row: params of the fullest stage rank (or of pipeline rank ``pp_rank``), params per
    layer, layers of that stage."""
    keys = cols.tp * 100_000 + cols.pp
    unique, inverse = np.unique(keys, return_inverse=True)
    max_params = np.empty(len(unique))
    per_layer = np.empty(len(unique))
    layers = np.empty(len(unique))
    for i, key in enumerate(unique):
        tp, pp = divmod(int(key), 100_000)
        sharded = sharded_params(cfg, tp)
        if pp_rank is None:
            max_params[i] = sharded.max_stage_params(pp)
            layers[i] = -(-cfg.num_layers // pp)
        else:
            stage = min(pp_rank, pp - 1)
            max_params[i] = sharded.stage_params(pp)[stage]
            layers[i] = sharded.stage_layers(pp)[stage]
        per_layer[i] = sharded.per_layer
    return max_params[inverse], per_layer[inverse], layers[inverse]


def memory_columns(cfg: ModelConfig, seq_len: int, global_batch: int, cols: LayoutColumns,
                   settings: PlanSettings, *, pp_rank: int | None = None
                   ) -> dict[str, np.ndarray]:
    """Bytes per device by component for every row of ``cols``: of the fullest pipeline rank,
    or of pipeline rank ``pp_rank`` (its stage's parameters, activations and receive
    buffers)."""
    p_bytes, g_bytes, o_bytes, gather_bytes = settings.bytes_per_param
    stage_params, layer_params, stage_layers = stage_tables(cfg, cols, pp_rank)
    # ZeRO shards over dp_shard x cp (FSDP's group; ZeRO-1/2 run with cp = 1)
    params, grads, optim = zero_model_state_bytes(
        stage_params, cols.dp_shard * cols.cp, cols.zero_stage, p_bytes, g_bytes, o_bytes
    )
    microbatches = global_batch // (cols.dp * cols.micro_batch_size)
    local_seq = seq_len / cols.cp
    # FSDP (stage 3, shard > 1, or over one rank: ``single_rank_fsdp``) gathers parameters in
    # ``gather_bytes``: the embedding it gathers sets the residual stream's dtype, and so that
    # of the stages' outputs and receive buffers.
    fsdp = ((cols.zero_stage == 3) & (cols.dp_shard * cols.cp > 1)) | (
        settings.single_rank_fsdp & (cols.dp_shard * cols.cp == 1))
    stream_bytes = np.where(fsdp, gather_bytes, p_bytes)
    kwargs = dict(stream_bytes=stream_bytes, seq_len=local_seq,
                  micro_batch=cols.micro_batch_size, tp=cols.tp,
                  sequence_parallel=cols.sequence_parallel,
                  flash_attention=settings.flash_attention, dropout=settings.attention_dropout,
                  activation_bytes=settings.activation_bytes,
                  selective_keeps_matmul_outputs=settings.selective_keeps_matmul_outputs)
    per_layer = layer_activation_bytes(cfg, policy=cols.activation_checkpointing, **kwargs)
    # Full recompute rebuilds one layer's activations at a time during backward.
    working = layer_activation_bytes(cfg, policy=np.full(len(cols), AC_NONE), **kwargs)
    working = np.where(cols.activation_checkpointing == AC_FULL, working, 0.0)
    hidden = cols.micro_batch_size * local_seq * cfg.dim * stream_bytes  # residual, 1 chunk
    activations, recv = _pipeline_rank_memory(cols, settings, per_layer, stage_layers,
                                              microbatches, hidden, pp_rank=pp_rank or 0)
    # The second pipeline rank holds one (interleaved: two) chunk fewer in flight but, a
    # middle stage, receives both activations and gradients: it can be the fuller one.
    second = _pipeline_rank_memory(cols, settings, per_layer, stage_layers, microbatches,
                                   hidden, pp_rank=np.minimum(1, cols.pp - 1))
    take_second = (second[0] + second[1] > activations + recv) & (pp_rank is None)
    activations = np.where(take_second, second[0], activations) + working
    recv = np.where(take_second, second[1], recv)
    tokens = local_seq * cols.micro_batch_size
    head = 2.0 * settings.activation_bytes * tokens * cfg.embed_dim
    head = np.where(cols.sequence_parallel, head / cols.tp, head)
    if not settings.chunked_loss:  # bf16 logits + fp32 logits and their gradient
        head = head + tokens * cfg.padded_vocab_size * (settings.activation_bytes + 8) / cols.tp
    else:
        # the chunked loss makes the head's weight gradient in its forward, summed over the
        # chunks in fp32 ([P / tp, E]; `models.loss`, `parallel.loss`), held until backward
        # starts: at the activation peak without a pipeline (the end of the forward); a last
        # pipeline stage, one microbatch in flight, peaks later in its backward (traced:
        # PaLM 540B's rank 0, Llama 3 405B's last stage)
        _, holds_head = stage_ends(cols, pp_rank)
        head = head + np.where(cols.pp == 1, holds_head, 0.0) * (
            cfg.padded_vocab_size / cols.tp * cfg.embed_dim * 4.0)
    # FSDP: two layers gathered (current + prefetch) and one layer of unsharded gradients
    # waiting for reduce-scatter.
    buffers = np.where(fsdp, layer_params * (2 * gather_bytes + g_bytes), 0.0)
    buffers = buffers + settings.workspace_gb * 1e9
    buffers = buffers + recv
    grads_in_step = grads
    if settings.pp_keeps_stage_unsharded:
        # the stage's gradients accumulate unsharded (in the gradients' dtype) from the first
        # microbatch's backward to the last (``pp_accumulates_unsharded_grads``; else each
        # layer's are reduce-scattered in its backward); its parameters stay gathered between a
        # backward and the next forward, which reshards all but each stage's last block
        # (``pp_reshards_after_forward``): at the end of a forward, the activation peak, those
        # and the block prefetched for the backward are gathered; at the end of a backward
        # every unit is, while that microbatch's chunk has freed its activations: the rank's
        # peak is the larger moment (the per-layer FSDP buffers above are part of these here)
        whole_stage = (cols.pp > 1) & fsdp
        stage_gathered = stage_params * gather_bytes
        # a layer's gradients in its backward: in the gathered dtype, then (reduced every
        # microbatch) in the gradients' dtype for the reduce-scatter
        accumulating = settings.pp_accumulates_unsharded_grads
        # the stage's root unit (embedding, head) has its gradients from the stage backward's
        # start (the head) or end (the embedding) until that backward's end; under sequence
        # parallelism the block policy's backward also holds the two re-gathered normed inputs
        # and the gathered input gradient, whole-sequence
        root_params = np.maximum(stage_params - stage_layers * layer_params, 0.0)
        in_backward = (layer_params + root_params) * (
            gather_bytes + (0.0 if accumulating else g_bytes))
        regathered = cols.sequence_parallel & (cols.tp > 1) & (
            cols.activation_checkpointing != AC_FULL)
        in_backward = in_backward + np.where(regathered, 3.0 * hidden, 0.0)
        grads_held = stage_params * g_bytes if accumulating else 0.0
        if settings.pp_reshards_after_forward:
            after_forward = np.minimum((cols.pp_virtual_stages + 1.0) * layer_params,
                                       stage_params) * gather_bytes
            one_chunk = per_layer * stage_layers / cols.pp_virtual_stages
            gathered_bytes = np.maximum(after_forward, stage_gathered - one_chunk + in_backward)
        else:
            gathered_bytes = stage_gathered + in_backward
        buffers = np.where(whole_stage, gathered_bytes + grads_held
                           + settings.workspace_gb * 1e9 + recv, buffers)
        if accumulating:
            # the sharded gradients are made by the last microbatch's reduce-scatter, layer
            # by layer as the unsharded ones are freed: until then the stage holds only the
            # unsharded ones (``grads_held``), the same bytes under a one-rank shard group
            grads_in_step = np.where(whole_stage, 0.0, grads)
    # The optimizer step: the model states, the pipeline's receive buffers (kept for the
    # schedule's life) and the step's temporaries (torch's foreach AdamW makes fp32 lists the
    # size of the rank's parameters).
    step = params + grads + optim + recv + settings.optimizer_step_temporaries * (
        params * 4 / p_bytes)
    total = np.maximum(params + grads_in_step + optim + activations + head + buffers, step)
    return {"params": params, "grads": grads, "optimizer": optim, "activations": activations,
            "head": head, "buffers": buffers, "optimizer_step": step, "total": total,
            "stage_params": stage_params, "layer_params": layer_params,
            "stage_layers": stage_layers.astype(np.float64),
            "microbatches": microbatches.astype(np.float64),
            **dict(zip(("stage_embedding", "stage_head"), stage_ends(cols, pp_rank),
                       strict=True))}


def stage_ends(cols: LayoutColumns, pp_rank: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Whether pipeline rank ``pp_rank``'s stages hold the token embedding (the first stage)
    and the output head (the last): both without a pipeline and on ZB-V's rank 0 (its V holds
    the first and the last stage), else the first on rank 0 and the last on rank pp - 1 (1.0
    or 0.0 per row). With no rank named (the planner's step time) both, an upper bound."""
    if pp_rank is None:
        return np.ones(len(cols)), np.ones(len(cols))
    rank = np.broadcast_to(np.asarray(pp_rank), (len(cols),))
    zbv = cols.pp_schedule == PP_SCHEDULES.index("zbv")
    first = (rank == 0).astype(np.float64)
    last = np.where(zbv, rank == 0, rank == cols.pp - 1).astype(np.float64)
    return first, last
