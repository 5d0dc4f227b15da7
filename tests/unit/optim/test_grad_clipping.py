"""Global-norm clipping on plain tensors, on DTensor shards and on an FSDP2 model (2 gloo
ranks), against the norm of the full gradients computed directly in one process."""

import math

import pytest
import torch
from torch import nn

from densetrain.optim import clip_grad_norm_
from densetrain.testing import run_distributed


def _params_with_grads(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(6, 4)), nn.Parameter(torch.zeros(4)),
              nn.Parameter(torch.zeros(2, 3))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _direct_norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def test_clips_to_max_norm_and_returns_the_norm_before():
    params = _params_with_grads()
    grads = [p.grad.clone() for p in params]
    total = _direct_norm(grads)
    returned = clip_grad_norm_(params, max_norm=1.0)
    assert float(returned) == pytest.approx(total, rel=1e-6)
    assert _direct_norm([p.grad for p in params]) == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g / total, rtol=1e-5, atol=1e-7)


def test_below_threshold_or_off_leaves_gradients():
    params = _params_with_grads()
    grads = [p.grad.clone() for p in params]
    total = _direct_norm(grads)
    clip_grad_norm_(params, max_norm=total * 2)
    clip_grad_norm_(params, max_norm=0.0)  # optim.grad_clip = 0: measure only
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g)
    inf_norm = clip_grad_norm_(params, max_norm=0.0, norm_type=math.inf)
    assert float(inf_norm) == pytest.approx(max(float(g.abs().max()) for g in grads))
    assert float(clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)) == 0.0


def _clip_dtensor_shards(rank: int, world_size: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _params_with_grads(seed=5)
    sharded = []
    for p in full:
        local = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        local.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        sharded.append(local)
    total = clip_grad_norm_(sharded, max_norm=0.5)
    fsdp_total, fsdp_grads = _clip_fsdp2_model(mesh)
    return float(total), [p.grad.full_tensor() for p in sharded], fsdp_total, fsdp_grads


def _tiny_model_grads() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    inputs = torch.randn(5, 4, generator=torch.Generator().manual_seed(8))
    return model, inputs


def _clip_fsdp2_model(mesh) -> tuple[float, list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    model, inputs = _tiny_model_grads()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(inputs).square().sum().backward()  # every rank feeds the same batch
    total = clip_grad_norm_(model.parameters(), max_norm=0.1)
    return float(total), [p.grad.full_tensor() for p in model.parameters()]


def test_dtensor_shards_clip_like_the_full_gradients():
    reference = _params_with_grads(seed=5)
    total = _direct_norm([p.grad for p in reference])
    clip_grad_norm_(reference, max_norm=0.5)
    model, inputs = _tiny_model_grads()
    model(inputs).square().sum().backward()
    model_total = _direct_norm([p.grad for p in model.parameters()])
    clip_grad_norm_(model.parameters(), max_norm=0.1)
    results = run_distributed(_clip_dtensor_shards, 2, timeout=180)
    for rank_total, rank_grads, fsdp_total, fsdp_grads in results:
        assert rank_total == pytest.approx(total, rel=1e-5)
        for got, expected in zip(rank_grads, reference, strict=True):
            torch.testing.assert_close(got, expected.grad, rtol=1e-5, atol=1e-7)
        assert fsdp_total == pytest.approx(model_total, rel=1e-5)
        for got, expected in zip(fsdp_grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, expected.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.3, 1e6])  # clipping, and a bound above the norm
def test_a_fused_adamw_scales_by_the_clip_in_its_own_step(max_norm):
    """Over torch's fused AdamW the clip's scale rides on the update (StandardOptimizer passes
    it as the optimizer's grad_scale): parameters, moments and the gradients left behind match
    torch's clip_grad_norm_ followed by the same AdamW step, to one rounding of the scale."""
    from densetrain.optim.interface import StandardOptimizer

    model = nn.Linear(4, 6)
    ours = [model.weight, model.bias]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = StandardOptimizer(model, torch.optim.AdamW(ours, lr=0.1, fused=True))
    reference = torch.optim.AdamW(theirs, lr=0.1, fused=True)
    assert opt._clips_in_step(ours)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for mine, ref in zip(ours, theirs, strict=True):
            mine.grad = torch.randn(mine.shape, generator=gen) * 2
            ref.grad = mine.grad.clone()
        unscaled = [p.grad.clone() for p in ours]
        norm = opt.clip_grad_norm_(max_norm)
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, unscaled, strict=True))
        ref_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        opt.step()
        reference.step()
        assert not hasattr(opt.torch_optimizer, "grad_scale")
        for mine, ref in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-6, atol=0)
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.torch_optimizer.state[mine][key],
                                           reference.state[ref][key], rtol=1e-5, atol=0)
        opt.zero_grad()
        reference.zero_grad()


def test_dropped_gradients_drop_the_pending_clip_and_other_optimizers_clip_at_once():
    from densetrain.optim.interface import StandardOptimizer

    model = nn.Linear(4, 6)
    opt = StandardOptimizer(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    model.weight.grad = torch.full((6, 4), 3.0)
    model.bias.grad = torch.full((6,), 3.0)
    opt.clip_grad_norm_(0.5)
    opt.zero_grad()  # a skipped step: the clip measured for these gradients goes with them
    assert opt._grad_scale is None
    foreach = StandardOptimizer(model, torch.optim.AdamW(model.parameters(), lr=0.1,
                                                         foreach=True))
    model.weight.grad = torch.full((6, 4), 3.0)
    model.bias.grad = torch.full((6,), 3.0)
    assert not foreach._clips_in_step(list(model.parameters()))
    norm = foreach.clip_grad_norm_(0.5)
    assert float(norm) == pytest.approx(3.0 * math.sqrt(30))
    clipped = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
    assert clipped == pytest.approx(0.5, rel=1e-5)  # scaled in the clip itself
