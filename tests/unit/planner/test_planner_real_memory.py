"""The planner's model-state bytes per rank equal what real gloo ranks hold after an AdamW step.

Each layout is built on 2 CPU ranks from a tiny ``Transformer``: plain data parallel (replicas,
all-reduced gradients), ZeRO-1/2 (``densetrain.parallel.zero.ZeroOptimizer``), ZeRO-3 (PyTorch
FSDP2 ``fully_shard`` per block and at the root) and tensor parallel (DTensor plans of
``densetrain.parallel.tensor``). The measured bytes are the local shards of parameters, of
gradients right after backward, and of AdamW's ``exp_avg``/``exp_avg_sq`` after the step, all
fp32; the prediction is ``zero_model_state_bytes`` with the ``fp32`` precision (4, 4, 8 bytes).
With every sharded size even, the prediction is exact on every rank. With an odd vocabulary, the
vocab-parallel rows split unevenly (129 + 128 for 257) and the planner's ceil(V/tp) rows are
those of the fullest rank: exact on that rank, the other within one row per vocab matrix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from densetrain.models import ModelConfig, Transformer
from densetrain.planner.memory import zero_model_state_bytes
from densetrain.planner.params import sharded_params
from densetrain.testing import run_distributed

WORLD = 2


def _tiny(vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_dim=96, max_seq_len=16, activation="swiglu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _adam_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _nbytes(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))


def _loss(model: torch.nn.Module, cfg: ModelConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
    logits = model(tokens)
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return logits.float().square().mean()


def _build(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def _measure(kind: str, cfg: ModelConfig) -> dict[str, int]:
    """Bytes of params, grads and optimizer states this rank holds for one layout ``kind``."""
    from densetrain.parallel.tensor import apply_tensor_parallel
    from densetrain.parallel.zero import ZeroOptimizer

    model = _build(cfg)
    adamw = lambda groups: torch.optim.AdamW(groups, lr=1e-3)  # noqa: E731
    mesh = init_device_mesh("cpu", (WORLD,))
    if kind in ("zero1", "zero2"):
        opt = ZeroOptimizer(model.parameters(), adamw, group=dist.group.WORLD,
                            stage=int(kind[-1]))
    else:
        if kind == "zero3":
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif kind == "tp":
            apply_tensor_parallel(model, mesh, sequence_parallel=False)
        opt = adamw(model.parameters())
    _loss(model, cfg).backward()
    if kind == "dp":
        for p in model.parameters():
            dist.all_reduce(p.grad)
    named_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    embedding_grad = named_grads.get("tok_embeddings.weight")
    grads = opt.grad_shards() if kind == "zero2" else list(named_grads.values())
    out = {"grads": _nbytes(grads),
           "embedding_grad": _nbytes([embedding_grad]) if embedding_grad is not None else 0,
           "embedding_param": _nbytes([model.tok_embeddings.weight])}
    opt.step()
    out["optimizer"] = _adam_state_bytes(opt.torch_optimizer if kind in ("zero1", "zero2") else opt)
    out["params"] = _nbytes(model.parameters())
    return out


def _all_layouts(rank: int, world_size: int, jobs: tuple[tuple[int, tuple[str, ...]], ...]):
    torch.set_num_threads(1)
    return {(vocab, kind): _measure(kind, _tiny(vocab)) for vocab, kinds in jobs for kind in kinds}


def _predicted(cfg: ModelConfig, kind: str) -> dict[str, float]:
    tp = WORLD if kind == "tp" else 1
    stage = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "tp": 0}[kind]
    shard = 1 if kind in ("dp", "tp") else WORLD
    psi = sharded_params(cfg, tp).total()
    values = zero_model_state_bytes(psi, shard, stage, 4, 4, 8)
    return dict(zip(("params", "grads", "optimizer"), (float(v) for v in values), strict=True))


KINDS = ("dp", "zero1", "zero2", "zero3", "tp")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    """Per-rank measurements of every layout (one spawn of 2 gloo ranks for the module)."""
    return run_distributed(_all_layouts, WORLD, ((256, KINDS), (257, ("tp", "zero3"))),
                           timeout=240)


def _states(row: dict) -> dict[str, float]:
    return {"params": row["params"], "grads": row["grads"], "optimizer": row["optimizer"]}


def test_model_states_match_ranks_exactly_with_even_sizes(measured):
    cfg = _tiny(256)
    for kind in KINDS:
        expected = _predicted(cfg, kind)
        for rank, per_rank in enumerate(measured):
            got = _states(per_rank[(256, kind)])
            assert got == expected, (kind, rank)


def test_vocab_parallel_embedding_gradient_is_sharded(measured):
    # each tp rank computes its own vocabulary rows' gradient only (parallel.tensor's
    # vocab-parallel lookup), never a whole-vocabulary one
    for per_rank in measured:
        row = per_rank[(256, "tp")]
        assert row["embedding_grad"] == row["embedding_param"]


def test_uneven_vocab_split_matches_the_fullest_rank(measured):
    cfg = _tiny(257)
    expected = _predicted(cfg, "tp")
    tp_rows = [_states(r[(257, "tp")]) for r in measured]
    assert max(r["params"] for r in tp_rows) == expected["params"]
    assert max(r["optimizer"] for r in tp_rows) == expected["optimizer"]
    one_row_each = 2 * cfg.dim * 4  # an embedding and an output row, fp32
    for row in tp_rows:
        assert 0 <= expected["params"] - row["params"] <= one_row_each
    # FSDP2 splits each tensor's rows as torch.chunk does: the ranks' sum is exactly N x Psi/N.
    zero3 = _predicted(cfg, "zero3")
    for name in ("params", "grads", "optimizer"):
        assert sum(r[(257, "zero3")][name] for r in measured) == WORLD * zero3[name]
