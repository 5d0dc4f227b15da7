"""Communication volume per device and step, by kind, and the links each kind runs over.

Mesh axes are laid out outermost first as ``pp x dp_replicate x dp_shard x cp x tp`` (the order
of ``ParallelConfig``), so a group of an axis spans (its degree x the inner degrees) consecutive
devices and stays on the intra-node fabric iff that span fits in a node. Volumes are bytes each
device sends with ring collectives: all-reduce 2(n-1)/n x size, all-gather and reduce-scatter
(n-1)/n x size (Patarasuk & Yuan 2009; the factors the ZeRO paper uses).

- TP (Megatron, Shoeybi et al. 2019): per layer and microbatch two all-reduces in forward and
  two in backward of the b·s·h activations (sequence parallel swaps each for an all-gather plus a
  reduce-scatter, the same bytes), fewer for parallel blocks (`tp_block_calls`); full
  recompute repeats the forward's; plus the vocab-parallel embedding's forward all-reduce and
  the output's backward all-reduce, on the stages that hold them, and the gathers at a
  sequence-parallel pipeline's stage boundaries (`_tp_stage_calls`); the backward's recompute
  repeats some of the forward's (`_tp_recompute_calls`).
- DP/FSDP: stage 0 all-reduces gradients once a step; stage 1 reduce-scatters them and
  all-gathers the updated parameters; stage 2 reduce-scatters every microbatch; stage 3
  all-gathers parameters in forward and in backward and reduce-scatters gradients every
  microbatch (1.5x stage 0 at one microbatch, as in the ZeRO paper); under pipeline parallelism
  the stage stays gathered between microbatches and reduces once (`fsdp_calls_per_step`). HSDP
  adds an all-reduce of the gradient shard over ``dp_replicate``.
- PP: each microbatch's activation forward and its gradient backward at every stage boundary,
  times the virtual stages: whole on every tp rank (torch's pipeline stages, the trainer's), or
  split over tp ranks (Megatron's scatter/gather, ``PlanSettings.pp_scatter_gather``).
- CP (ring attention): each layer passes K and V around the ring in forward, and K, V and their
  gradients in backward.
"""

from __future__ import annotations

import numpy as np

from densetrain.models.config import ModelConfig
from densetrain.parallel.layout_check import kv_split
from densetrain.planner.hardware import ClusterSpec
from densetrain.planner.layout import AC_POLICIES, LayoutColumns, PlanSettings

_FULL = AC_POLICIES.index("full")
TP_CALLS_PER_LAYER = 4
"""Tensor-parallel collectives per layer and microbatch: two in the forward, two in the
backward (full recompute repeats the forward's two)."""
FSDP_CALLS_PER_LAYER = 3
"""FSDP collectives per layer and microbatch: an all-gather in the forward and in the backward,
a reduce-scatter of the gradients."""


def ring_factor(n, kind: str):
    """Bytes sent per device per byte of payload for a ring ``kind`` over ``n`` ranks."""
    n = np.asarray(n, dtype=np.float64)
    share = (n - 1) / n
    return 2 * share if kind == "all_reduce" else share


def ring_steps(n):
    """Latency steps of one collective over ``n`` ranks: 2 log2(n) (a tree's up and down)."""
    return 2 * np.ceil(np.log2(np.maximum(n, 2)))


def link(cluster: ClusterSpec, span, payload_bytes):
    """(bandwidth, latency) per row for a group spanning ``span`` consecutive devices that moves
    ``payload_bytes`` per collective: the link's bandwidth x ``collective_efficiency`` x
    S / (S + ``collective_half_bytes``) (``hardware.ClusterSpec``)."""
    inside = np.asarray(span) <= cluster.devices_per_node
    bandwidth = np.where(inside, cluster.intra_node_bytes_per_s, cluster.inter_node_bytes_per_s)
    payload = np.maximum(np.asarray(payload_bytes, dtype=np.float64), 1.0)
    bandwidth = bandwidth * cluster.collective_efficiency * payload / (
        payload + cluster.collective_half_bytes)
    latency = np.where(inside, cluster.intra_node_latency_s, cluster.inter_node_latency_s)
    return bandwidth, latency


def comm_columns(cfg: ModelConfig, seq_len: int, cols: LayoutColumns, settings: PlanSettings,
                 cluster: ClusterSpec, mem: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Bytes sent per device per step (``*_bytes``) and unoverlapped link time (``*_s``)."""
    _, g_bytes, _, gather_bytes = settings.bytes_per_param
    e = settings.activation_bytes
    m = mem["microbatches"]
    layers = mem["stage_layers"]
    tp, cp, shard, rep = (c.astype(np.float64) for c in (cols.tp, cols.cp, cols.dp_shard,
                                                         cols.dp_replicate))
    act = cols.micro_batch_size * (seq_len / cp) * cfg.dim * e  # one b·s·h activation
    out = {}

    per_layer = tp_block_calls(cfg, cols.sequence_parallel) + _tp_recompute_calls(cfg, cols,
                                                                                   settings)
    n_tp = (layers * per_layer + _tp_stage_calls(cfg, cols, mem)) * m * (tp > 1)
    bw, lat = link(cluster, tp, act)
    out["tp_bytes"] = n_tp * ring_factor(tp, "all_reduce") * act
    out["tp_s"] = out["tp_bytes"] / bw + n_tp * lat * ring_steps(tp)
    # fewer kv heads than tp ranks (MQA, `parallel.tensor._ReplicatedKV`): each rank's wk and wv
    # gradients, zero outside its kv head, are all-reduced over tp in every backward
    kv_ways = kv_split(cfg.num_kv_heads, tp)
    n_kv = np.where((tp > 1) & (kv_ways < tp), 2.0 * layers * m, 0.0)
    kv_grad = (cfg.kv_dim * cfg.dim + (cfg.kv_dim if cfg.qkv_bias else 0)) * e
    bw, lat = link(cluster, tp, kv_grad)
    kv_bytes = n_kv * ring_factor(tp, "all_reduce") * kv_grad
    out["tp_bytes"] = out["tp_bytes"] + kv_bytes
    out["tp_s"] = out["tp_s"] + kv_bytes / bw + n_kv * lat * ring_steps(tp)

    kv_local = cfg.kv_dim / kv_split(cfg.num_kv_heads, tp)
    kv_chunk = 2 * cols.micro_batch_size * (seq_len / cp) * kv_local * e
    passes = np.where(cols.activation_checkpointing == _FULL, 4.0, 3.0)
    out["cp_bytes"] = layers * m * passes * (cp - 1) * kv_chunk
    bw, lat = link(cluster, tp * cp, kv_chunk)
    out["cp_s"] = out["cp_bytes"] / bw + layers * m * passes * (cp - 1) * lat

    boundaries = (cols.pp > 1) * 2.0 * m * cols.pp_virtual_stages
    pp_act = act / tp if settings.pp_scatter_gather else act
    out["pp_bytes"] = boundaries * pp_act
    bw, lat = link(cluster, tp * cp * shard * rep * np.minimum(cols.pp, 2), pp_act)
    out["pp_s"] = out["pp_bytes"] / bw + boundaries * lat

    out.update(_dp_comm(cols, mem, cluster, settings, tp * cp, layers))
    return out


def _tp_stage_calls(cfg: ModelConfig, cols: LayoutColumns, mem: dict[str, np.ndarray]
                    ) -> np.ndarray:
    """Tensor-parallel collectives (in all-reduce equivalents) per microbatch outside the
    blocks: the vocab-parallel embedding's (one, on the stage that holds it) and the output
    head's (one, on the last stage); under sequence parallelism the learned position table's
    gradient gathered back to whole (half, on the embedding's stage), and at the pipeline's
    stage boundaries the sent output gathered from its sequence shards (half per stage that
    sends) and the received input's gradient (half per stage that receives). Traced by the dry
    runs of Korthikanti et al.'s and Narayanan et al.'s layouts (docs/planner.md)."""
    embedding, head = mem["stage_embedding"], mem["stage_head"]
    sp = cols.sequence_parallel & (cols.tp > 1)
    v = cols.pp_virtual_stages.astype(np.float64)
    boundaries = np.where(sp & (cols.pp > 1), 0.5 * ((v - head) + (v - embedding)), 0.0)
    positions = np.where(sp, 0.5 * embedding, 0.0) if cfg.position_embedding == "learned" else 0.0
    return embedding + head + boundaries + positions


def _parallel_block(cfg: ModelConfig) -> tuple[bool, bool]:
    """(whether ``cfg``'s blocks are parallel attention + MLP blocks whose branches are reduced
    together, whether one norm feeds both branches)."""
    joined = cfg.block_type == "parallel" and not cfg.dropout
    return joined, cfg.block_type == "parallel" and cfg.parallel_shared_norm


def tp_block_calls(cfg: ModelConfig, sequence_parallel) -> np.ndarray:
    """Tensor-parallel collectives (in all-reduce equivalents) per layer and microbatch, forward
    and backward (`parallel.tensor`). A sequential block: two all-reduces each way (under
    sequence parallelism each is an all-gather plus a reduce-scatter of the same bytes), 4.
    A parallel block (GPT-J, NeoX, PaLM) reduces the sum of its branches' partial sums once:
    with one shared norm its input is gathered once and its gradient reduced once, 2 (1 + 1);
    with two norms (NeoX) each branch's input is gathered and its gradient reduced, 3 (1 + 2,
    or 1.5 + 1.5 under sequence parallelism). With dropout each branch is dropped after its
    own reduction, one more all-reduce equivalent."""
    sp = np.asarray(sequence_parallel, dtype=bool)
    joined, shared = _parallel_block(cfg)
    if cfg.block_type != "parallel":
        calls = 4.0
    else:
        calls = (2.0 if shared else 3.0) + (0.0 if joined else 1.0)
    return np.full(sp.shape, calls)


def _tp_recompute_calls(cfg: ModelConfig, cols: LayoutColumns, settings: PlanSettings
                        ) -> np.ndarray:
    """Tensor-parallel collectives (in all-reduce equivalents) the backward's recompute repeats
    per layer and microbatch. Megatron-LM's full recompute re-runs the layer forward, its two
    all-reduces. torch's checkpoint as the trainer runs it stops once the tensors backward needs
    are rebuilt (``checkpoint_early_stop``), so the layer's last reduction (after the MLP) is not
    repeated: one all-reduce, or under sequence parallelism both all-gathers and the first
    reduce-scatter (1.5). The trainer's block policy (``selective``, and ``none`` under sequence
    parallelism; `parallel.checkpointing`) keeps the reduced attention output and gathers the
    two normed sequence shards again in backward, as Megatron-LM's sequence parallelism does:
    two all-gathers (1.0) under sequence parallelism, nothing without it."""
    sp = cols.sequence_parallel
    joined, shared = _parallel_block(cfg)
    gathers = 0.5 if shared else 1.0  # the normed shards a block gathers, 0.5 each
    if cfg.block_type != "parallel":
        early, forward = np.where(sp, 1.5, 1.0), np.full(len(cols), 2.0)
    else:
        # a parallel block's forward: its gathers, then its reduction(s); the early stop leaves
        # out the last reduction
        reductions = 1.0 if joined else 2.0
        forward = np.where(sp, gathers + 0.5 * reductions, reductions)
        early = np.where(sp, gathers + 0.5 * (reductions - 1), reductions - 1)
    # residual dropout after the block's last reduction keeps a mask backward reads: the
    # recompute runs to the block's end
    full = early if settings.checkpoint_early_stop and not cfg.dropout else forward
    # the block policy ("none" and "selective" alike) re-gathers the normed shards
    regathered = sp & (cols.tp > 1) & settings.selective_keeps_matmul_outputs
    return np.where(cols.activation_checkpointing == _FULL, full,
                    np.where(regathered, gathers, 0.0))


def fsdp_calls_per_step(cols: LayoutColumns, mem: dict[str, np.ndarray],
                        settings: PlanSettings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(all-gathers, reduce-scatters, all-gathers in forward) of ZeRO-3 per step, in
    whole-stage equivalents (the stage's parameters gathered or its gradients reduced once: 1.0).
    The gathers not in forward are in backward.

    Without pipeline parallelism every FSDP unit gathers in each microbatch's forward and again
    in its backward, and reduce-scatters its gradients in each backward: 2m and m.

    Under pipeline parallelism as torch's schedules run it (``pp_keeps_stage_unsharded``), the
    backward of every microbatch but the last leaves the stage gathered, so a unit gathers again
    only in a forward that follows another forward (resharded after it) and in a backward that
    follows a forward. Under GPipe and 1F1B that is m + 1 gathers a step for every unit (one at
    the first forward, one per backward that directly follows a forward), whatever the warm-up,
    except each stage's last block, which is never resharded after its forward and so gathers
    once. Traced by the dry runs of Llama 3 70B and 405B (161 gathers for the 40 units of a 70B
    first stage over 3 microbatches: 40 x 4 + 1; docs/planner.md). The interleaved and
    zero-bubble schedules are counted the same way, per virtual stage, unverified: torch's
    runtime for them gathers otherwise (211 gathers where the rule says 222 on a 70B rank of
    two virtual stages over 10 microbatches), which the dry run reports as not compared.
    Gradients are reduced once, by the last microbatch's backward
    (``pp_accumulates_unsharded_grads``; False: every microbatch, Llama 3's own pipelined FSDP).
    Without resharding after forward (``pp_reshards_after_forward`` False) a stage gathers once
    a step.
    """
    m = mem["microbatches"]
    psi = np.maximum(mem["stage_params"], 1.0)
    piped = (cols.pp > 1) & settings.pp_keeps_stage_unsharded
    last_blocks = np.minimum(cols.pp_virtual_stages * mem["layer_params"], psi)
    gathers_piped = ((m + 1.0) * (psi - last_blocks) + last_blocks) / psi
    if not settings.pp_reshards_after_forward:
        # ``parallel.pp_reshard_after_forward = false``: the stage stays gathered over the step
        gathers_piped = np.ones(len(cols))
    gathers = np.where(piped, gathers_piped, 2.0 * m)
    once = piped & settings.pp_accumulates_unsharded_grads
    # under the pipeline, the first forward's gathers stand for those of the warm-up forwards
    return gathers, np.where(once, 1.0, m), np.where(piped, 1.0, m)


def _dp_comm(cols: LayoutColumns, mem: dict[str, np.ndarray], cluster: ClusterSpec,
             settings: PlanSettings, inner, layers) -> dict[str, np.ndarray]:
    """Per-collective DP/FSDP times (for the overlap model) and the step's DP bytes.

    Each collective moves one layer's share (FSDP units are layers; DDP's gradient buckets are
    of that order), which sets its payload and so its bandwidth (``link``), and there is one
    per layer, each paying the latency. ``dp_ag_per_step`` and ``dp_rs_per_step``: how many
    times a step pays ``dp_all_gather_s`` and ``dp_reduce_scatter_s``."""
    _, g_bytes, _, gather_bytes = settings.bytes_per_param
    psi = mem["stage_params"]
    m = mem["microbatches"]
    stage = cols.zero_stage
    span, rep = cols.dp_shard.astype(np.float64), cols.dp_replicate.astype(np.float64)
    # FSDP shards over dp_shard x cp (the context-parallel ranks hold the same weights; the
    # trainer's ``dp_shard_cp`` group); the group spans tp x cp x dp_shard consecutive ranks
    shard = span * cols.cp
    dp = span * rep
    calls = np.maximum(layers, 1.0)  # one collective per layer's share, each with its latency
    unit = psi / calls
    bw_shard, lat_shard = link(cluster, inner * span, unit * gather_bytes)
    bw_rep, lat_rep = link(cluster, inner * span * rep, unit / shard * g_bytes)
    bw_all, lat_all = link(cluster, inner * dp, unit * g_bytes)
    lat_steps = lambda n: calls * ring_steps(n)  # noqa: E731
    # stage 0: one all-reduce of all gradients over dp.
    ar_bytes = ring_factor(dp, "all_reduce") * psi * g_bytes * (stage == 0)
    rs_bytes = ring_factor(shard, "reduce_scatter") * psi * g_bytes * (stage > 0)
    ag_bytes = ring_factor(shard, "all_gather") * psi * gather_bytes * (stage > 0)
    rep_bytes = ring_factor(rep, "all_reduce") * psi / shard * g_bytes * (stage > 0)
    t_ar = ar_bytes / bw_all + (dp > 1) * lat_all * lat_steps(dp)
    t_rs = rs_bytes / bw_shard + (shard > 1) * lat_shard * lat_steps(shard)
    t_ag = ag_bytes / bw_shard + (shard > 1) * lat_shard * lat_steps(shard)
    t_rep = rep_bytes / bw_rep + (rep > 1) * lat_rep * lat_steps(rep)
    fsdp_gathers, fsdp_reduces, forward_gathers = fsdp_calls_per_step(cols, mem, settings)
    rs_per_step = np.where(stage == 3, fsdp_reduces, np.where(stage == 2, m, 1.0))
    ag_per_step = np.where(stage == 3, fsdp_gathers, 1.0)
    total = ar_bytes + rs_bytes * rs_per_step + ag_bytes * ag_per_step + rep_bytes
    return {"dp_bytes": total, "dp_allreduce_s": t_ar, "dp_reduce_scatter_s": t_rs,
            "dp_all_gather_s": t_ag, "dp_replicate_s": t_rep,
            "dp_ag_per_step": ag_per_step, "dp_rs_per_step": rs_per_step,
            "dp_ag_forward_per_step": np.where(stage == 3, forward_gathers, 0.0)}
