"""The step function: accumulation equals the full batch, clipping, the NaN policies."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch

from densetrain.models.loss import cross_entropy_loss
from densetrain.optim.interface import StandardOptimizer
from densetrain.parallel.model import SpmdModel
from densetrain.train import NonFiniteLossError, split_micro_batches, train_step


@dataclass(kw_only=True)
class _Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))


def _loss(model: torch.nn.Module, batch: _Batch):
    return cross_entropy_loss(model(batch.inputs), batch.targets)


def _batch() -> _Batch:
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 11, (4, 6), generator=gen)
    targets = torch.randint(0, 11, (4, 6), generator=gen)
    targets[0, :4] = -100  # micro-batches hold different numbers of counted tokens
    return _Batch(inputs=inputs, targets=targets)


def _run(model, batch, micro: int, *, loss_fn=_loss, clip: float = 0.0, policy: str = "stop",
         step: int = 1):
    opt = StandardOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5))
    return train_step(
        SpmdModel(module=model, loss_fn=loss_fn), opt, batch, micro_batch_size=micro,
        grad_clip=clip, autocast=contextlib.nullcontext, nan_policy=policy, step=step,
    )


def _step(model, batch, micro: int, *, clip: float = 0.0, policy: str = "stop", step: int = 1):
    return _run(model, batch, micro, clip=clip, policy=policy, step=step)


def test_accumulation_matches_one_full_batch_reference() -> None:
    batch = _batch()
    reference = _model()
    loss = _loss(reference, batch).loss  # mean over all counted tokens
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    accumulated = _model()
    out = _step(accumulated, batch, micro=1)
    assert int(out.num_tokens) == 4 * 6 - 4 and not out.skipped
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.grad_norm, norm, rtol=1e-5, atol=1e-6)
    for p, q in zip(accumulated.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_clipping_scales_the_update_to_the_max_norm() -> None:
    batch = _batch()
    free, clipped = _model(), _model()
    before = [p.detach().clone() for p in clipped.parameters()]
    out_free = _step(free, batch, micro=2)
    out_clip = _step(clipped, batch, micro=2, clip=1e-3)
    assert float(out_clip.grad_norm) == pytest.approx(float(out_free.grad_norm), rel=1e-6)
    moved = [(p.detach() - b).flatten() for p, b in zip(clipped.parameters(), before, strict=True)]
    update_norm = float(torch.cat(moved).norm())
    assert update_norm == pytest.approx(0.5 * 1e-3, rel=1e-3)  # lr × max_norm


def _nan_loss(model, batch):
    out = _loss(model, batch)
    return out._replace(loss=out.loss * float("nan"))


def test_nan_loss_stops_naming_the_step_and_leaves_weights() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLossError, match="step 7"):
        _run(model, _batch(), 4, loss_fn=_nan_loss, clip=1.0, policy="stop", step=7)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_nan_loss_skip_policy_skips_the_update() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    out = _run(model, _batch(), 4, loss_fn=_nan_loss, clip=1.0, policy="skip", step=3)
    assert out.skipped and int(out.num_tokens) == 0 and math.isnan(float(out.loss))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_split_rejects_indivisible_micro_batch() -> None:
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        split_micro_batches(_batch(), 3)


def test_the_step_makes_exactly_one_host_sync(monkeypatch) -> None:
    """Every place densetrain's own code turns a tensor into a Python value (on a GPU a host
    sync) during a step of a real model with micro-batches, the chunked head and clipping: one,
    the finiteness check. Calls from torch's own code (the optimizer's CPU step counters) are
    not densetrain's and are not counted; nor are the chunked loss's CPU-only reads, its
    underflow check and its unit-seed check (`test_the_chunk_kernel_reads_no_value_off_the_cpu`
    and `test_the_unit_seed_check_reads_no_value_off_the_cpu` show other devices skip them)."""
    import sys

    from densetrain.models import ModelConfig, Transformer
    from densetrain.parallel.model import model_loss_fn

    calls: list[str] = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            cpu_only = (caller.f_code.co_name in ("_softmax_and_lse", "_unit_seed_on_cpu")
                        and self.device.type == "cpu")
            if "densetrain" in caller.f_code.co_filename.replace("\\", "/").split("/") and not (
                cpu_only
            ):
                calls.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(self, *args, **kwargs)

        return wrapper

    cfg = ModelConfig(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_dim=64, max_seq_len=16)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = _Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:])
    opt = StandardOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    laid_out = SpmdModel(module=model, loss_fn=model_loss_fn(8))
    for name in ("__bool__", "__int__", "__float__", "item", "tolist", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    out = train_step(laid_out, opt, batch, micro_batch_size=2, grad_clip=1.0,
                     autocast=contextlib.nullcontext, nan_policy="stop", step=1)
    monkeypatch.undo()
    assert len(calls) == 1, calls
    assert "step.py" in calls[0] and not out.skipped
