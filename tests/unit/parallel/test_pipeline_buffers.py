"""The trainer's pipeline stages make their receive buffers per transfer (`parallel.pipeline`):
on real gloo ranks, every buffer a stage received into during a step is released by its end,
the number of buffers alive at once never exceeds the microbatches in flight, and a second
step receives into fresh buffers; torch's own stage keeps one buffer per microbatch."""

from __future__ import annotations

import contextlib
import weakref

import torch

from densetrain.models.config import ModelConfig
from densetrain.testing import run_distributed

MICROBATCHES = 6


def _step_twice(rank: int, world: int) -> dict:
    from densetrain.data import Batch
    from densetrain.parallel.build import build_model
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims

    cfg = ParallelConfig(pp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=MICROBATCHES)
    pmesh = ParallelDims.from_config(cfg, world).build_mesh("cpu")
    model_cfg = ModelConfig(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_dim=64, max_seq_len=16)
    model = build_model(model_cfg, cfg, pmesh, device=torch.device("cpu"), seed=3,
                        local_batch_size=MICROBATCHES, micro_batch_size=1)
    stage = model.pipeline.schedule._stage  # a single-stage schedule's one stage
    received: list[weakref.ref] = []
    alive_max = 0
    original = stage._get_recv_ops

    def recording(infos):
        nonlocal alive_max
        ops = original(infos)
        received.extend(weakref.ref(info.buffer) for info in infos
                        if not info.is_root_arg and info.buffer is not None)
        alive_max = max(alive_max, sum(ref() is not None for ref in received))
        return ops

    stage._get_recv_ops = recording
    tokens = torch.randint(0, 97, (MICROBATCHES, 9), generator=torch.Generator().manual_seed(5))
    batch = model.prepare_batch(Batch(inputs=tokens[:, :-1].contiguous(),
                                      targets=tokens[:, 1:].contiguous()), torch.device("cpu"))
    losses, held_after = [], []
    for _ in range(2):
        loss, _ = model.forward_backward(batch, micro_batch_size=1,
                                         autocast=contextlib.nullcontext)
        losses.append(float(loss))
        infos = [i for table in (stage.args_recv_info, stage.grad_recv_info)
                 for infos in table.values() for i in infos if not i.is_root_arg]
        held_after.append(sum(i.buffer is not None for i in infos))
        for param in model.module.parameters():
            param.grad = None
    return {"received": len(received), "alive_max": alive_max, "held_after": held_after,
            "losses": losses, "first": model.pipeline.has_first_stage}


def test_receive_buffers_live_per_transfer():
    for result in run_distributed(_step_twice, 2):
        # each rank receives one tensor per microbatch and step (stage 1 activations, stage 0
        # gradients), each into a buffer made for that transfer
        assert result["received"] == 2 * MICROBATCHES
        assert result["held_after"] == [0, 0]
        # 1F1B holds at most pp = 2 microbatches in flight on the last stage; the first stage
        # consumes each gradient at once (torch's stage: MICROBATCHES alive through the step)
        assert result["alive_max"] <= 2
        assert result["losses"][0] == result["losses"][1]


SENT_MICROBATCHES = 8


def _sent_outputs_alive(rank: int, world: int, tp: int) -> dict:
    """One 1F1B step over ``world // tp`` stages; at every send of the first stage, how many of
    its earlier sent outputs' storages are still alive."""
    from densetrain.data import Batch
    from densetrain.parallel.build import build_model
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims

    pp = world // tp
    cfg = ParallelConfig(pp=pp, tp=tp, dp_shard=1, pp_schedule="1f1b",
                         pp_microbatches=SENT_MICROBATCHES)
    pmesh = ParallelDims.from_config(cfg, world).build_mesh("cpu")
    model_cfg = ModelConfig(vocab_size=97, dim=32, num_layers=pp, num_heads=4, num_kv_heads=2,
                            ffn_dim=64, max_seq_len=16)
    model = build_model(model_cfg, cfg, pmesh, device=torch.device("cpu"), seed=3,
                        local_batch_size=SENT_MICROBATCHES, micro_batch_size=1)
    stage = model.pipeline.schedule._stage
    sent: list[weakref.ref] = []
    alive_at_send: list[int] = []
    original = stage.get_fwd_send_ops

    def recording(chunk: int):
        alive_at_send.append(sum(ref() is not None for ref in sent))
        output = stage.fwd_cache[chunk][0][0]
        storage = (output._base if output._is_view() else output).untyped_storage()
        ops = original(chunk)
        sent.append(weakref.ref(storage))
        return ops

    stage.get_fwd_send_ops = recording
    tokens = torch.randint(0, 97, (SENT_MICROBATCHES, 9),
                           generator=torch.Generator().manual_seed(5))
    batch = model.prepare_batch(Batch(inputs=tokens[:, :-1].contiguous(),
                                      targets=tokens[:, 1:].contiguous()), torch.device("cpu"))
    model.forward_backward(batch, micro_batch_size=1, autocast=contextlib.nullcontext)
    return {"first": model.pipeline.has_first_stage, "alive": alive_at_send}


def test_sent_outputs_are_freed_once_sent():
    # 8 stages: the first runs pp - 1 = 7 forwards before its first backward, and torch keeps
    # each output until that microbatch's backward (7 alive at the eighth send); freed once
    # sent, only the sends still in flight hold theirs (1F1B waits for a send one or two
    # sends later). With tp 2 and sequence parallelism (4 stages, 3 outputs kept before) the
    # output is the gathered sequence (`parallel.tensor._GatherSequence`).
    for world, tp in ((8, 1), (8, 2)):
        for result in run_distributed(_sent_outputs_alive, world, tp):
            if result["first"]:
                assert len(result["alive"]) == SENT_MICROBATCHES
                assert max(result["alive"]) <= 2, (tp, result["alive"])
