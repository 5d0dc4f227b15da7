"""`layer_activation_bytes`: what one transformer layer keeps for backward, per micro-batch, at
real size, traced on fake tensors.

One rank of a tensor-parallel group (the fake process group, `dryrun.world`) builds the model
with ``n`` and ``n + 1`` layers through `build_model` (TP/SP, activation checkpointing, FSDP over
two data-parallel ranks so that parameters are gathered in the compute dtype, as the published
jobs run), runs the forward of one micro-batch under bf16 autocast with the loss, and counts the
tensor storages alive after it (`trace.StepTracer`); the difference of the two counts is one
layer's share: every tensor kept for its backward, nothing of the embedding, the head or the
gathered weights. The planner's per-layer count and the analytic counts of the tests are
checked against this.
"""

from __future__ import annotations

import dataclasses

import torch

from densetrain.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """Bytes one layer keeps for backward, per micro-batch, on one tensor-parallel rank."""

    kept_bytes: int
    mode: str
    recompute: tuple[str, ...]
    tp: int
    sequence_parallel: bool
    seq_len: int
    micro_batch_size: int


def layer_activation_bytes(model_cfg: ModelConfig, *, tp: int, mode: str, seq_len: int,
                           micro_batch_size: int = 1, sequence_parallel: bool = True,
                           recompute: tuple[str, ...] = (), layers: int = 1) -> LayerMemory:
    """One layer's kept bytes (see the module docstring), measured in a fresh process."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    args = (model_cfg, tp, mode, seq_len, micro_batch_size, sequence_parallel,
            tuple(recompute))
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        small = pool.submit(_kept_after_forward, *args, layers).result()
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        large = pool.submit(_kept_after_forward, *args, layers + 1).result()
    return LayerMemory(kept_bytes=large - small, mode=mode, recompute=tuple(recompute), tp=tp,
                       sequence_parallel=sequence_parallel, seq_len=seq_len,
                       micro_batch_size=micro_batch_size)


def _kept_after_forward(model_cfg: ModelConfig, tp: int, mode: str, seq_len: int, micro: int,
                        sequence_parallel: bool, recompute: tuple[str, ...], layers: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from densetrain.dryrun.trace import StepTracer
    from densetrain.dryrun.world import fake_world
    from densetrain.parallel.build import build_model
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims

    cfg = dataclasses.replace(model_cfg, num_layers=layers)
    world = 2 * tp
    parallel = ParallelConfig(tp=tp, dp_shard=2, activation_checkpointing=mode,
                              ac_recompute=list(recompute),
                              sequence_parallel=sequence_parallel and tp > 1)
    with fake_world(world, 0):
        pmesh = ParallelDims.from_config(parallel, world).build_mesh("cpu")
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model = build_model(cfg, parallel, pmesh, device=torch.device("cpu"), seed=0,
                            loss_chunk_size=min(1024, seq_len), compute_dtype=torch.bfloat16,
                            materialize=lambda: fake)
        with fake:
            tokens = torch.zeros((micro, seq_len), dtype=torch.long)
            tracer = StepTracer({}, baseline=list(model.module.parameters()))
            before = tracer.live
            with tracer, torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.module(tokens, targets_BS=tokens, loss_chunk_size=min(1024, seq_len))
            kept = tracer.live - before
            del loss
    return kept
