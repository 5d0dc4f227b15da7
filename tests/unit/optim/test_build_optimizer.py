"""build_optimizer: torch's AdamW/SGD with the right groups, and PaLM-style Adafactor checked
against torch.optim.Adafactor (factored, no momentum) and against the paper's update rule."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from densetrain.optim import Adafactor, OptimConfig, build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4), nn.Linear(4, 6))


def test_adamw_decays_only_the_decay_group():
    model = _model()
    cfg = OptimConfig(name="adamw", lr=0.1, weight_decay=0.5, betas=[0.9, 0.95])
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["betas"] == (0.9, 0.95)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a zero gradient leaves only the decoupled decay
    optimizer.step()
    for name, param in model.named_parameters():
        if name == "2.weight":
            torch.testing.assert_close(param, before[name] * (1 - 0.1 * 0.5))
        else:  # embedding, norm weight/bias, linear bias
            torch.testing.assert_close(param, before[name])


def test_fused_adamw_is_the_cpu_default_and_matches_foreach():
    results = []
    for fused in (None, False):
        model = _model()
        optimizer = build_optimizer(model, OptimConfig(lr=0.01, fused=fused))
        assert optimizer.defaults["fused"] is (True if fused is None else None)
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            optimizer.step()
        results.append([p.detach() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sgd_and_plain_parameter_lists():
    model = _model()
    sgd = build_optimizer(model, OptimConfig(name="sgd", lr=0.1, betas=[0.8, 0.0]))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8
    flat = build_optimizer(model.parameters(), OptimConfig(weight_decay=0.3))
    assert len(flat.param_groups) == 1 and flat.param_groups[0]["weight_decay"] == 0.3
    with pytest.raises(ValueError, match="optim.name"):
        build_optimizer(model, OptimConfig(name="lion"))
    with pytest.raises(ValueError, match="optim.lr"):
        build_optimizer(model, OptimConfig(lr=-1e-3))


def _run(optimizer_factory, steps=6):
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(5, 7)), nn.Parameter(torch.randn(7))]
    optimizer = optimizer_factory(params)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach() for p in params]


def test_factored_adafactor_equals_torch_adafactor():
    # torch's Adafactor: factored, no momentum, step min(lr, 1/√k): equal while lr <= 1/√k.
    lr = 0.01
    ours = _run(lambda ps: Adafactor(ps, lr=lr, factored=True, weight_decay=0.1))
    theirs = _run(lambda ps: torch.optim.Adafactor(ps, lr=lr, weight_decay=0.1))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _paper_adafactor(params, grads_per_step, lr, beta1, decay_c, d, eps1, eps2, wd, power):
    """PaLM §5 / Shazeer & Stern 2018, unfactored, in float64 numpy."""
    params = [p.astype(np.float64) for p in params]
    v = [np.zeros_like(p) for p in params]
    m = [np.zeros_like(p) for p in params]
    for k, grads in enumerate(grads_per_step, start=1):
        beta2 = 1 - k ** (-decay_c)
        for i, g in enumerate(grads):
            v[i] = beta2 * v[i] + (1 - beta2) * (g * g + eps1)
            u = g / np.sqrt(v[i])
            u = u / max(1.0, math.sqrt(np.mean(u * u)) / d)
            m[i] = beta1 * m[i] + (1 - beta1) * u
            scale = max(eps2, math.sqrt(np.mean(params[i] ** 2)))
            params[i] = params[i] * (1 - wd * lr**power) - lr * scale * m[i]
    return params


def test_palm_adafactor_equals_the_paper_rule():
    torch.manual_seed(3)
    start = [torch.randn(4, 3), torch.randn(3) * 1e-4]  # the second hits the ε2 floor
    grads = [[torch.randn(4, 3), torch.randn(3)] for _ in range(5)]
    params = [nn.Parameter(t.clone()) for t in start]
    cfg = OptimConfig(name="adafactor", lr=0.05, betas=[0.9, 0.0], weight_decay=1.0,
                      weight_decay_lr_power=2.0)
    optimizer = build_optimizer(params, cfg)
    assert isinstance(optimizer, Adafactor)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    reference = _paper_adafactor(
        [t.numpy() for t in start], [[g.numpy() for g in gs] for gs in grads], lr=0.05,
        beta1=0.9, decay_c=0.8, d=1.0, eps1=1e-30, eps2=1e-3, wd=1.0, power=2.0)
    for p, ref in zip(params, reference, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), ref, rtol=2e-5, atol=1e-7)


def test_adafactor_state_is_saved_and_restored():
    params = [nn.Parameter(torch.randn(3, 2))]
    opt = Adafactor(params, lr=0.01, beta1=0.9)
    params[0].grad = torch.ones(3, 2)
    opt.step()
    state = opt.state_dict()
    clone = Adafactor([nn.Parameter(params[0].detach().clone())], lr=0.01, beta1=0.9)
    clone.load_state_dict(state)
    assert float(clone.state_dict()["state"][0]["step"]) == 1.0
    torch.testing.assert_close(clone.state_dict()["state"][0]["momentum"],
                               state["state"][0]["momentum"])
