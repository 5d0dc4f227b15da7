"""Adafactor as PaLM trained with it (Chowdhery et al. 2022, §5; Shazeer & Stern 2018).

Per parameter, at step k (1-based), with gradient g:

- β2_k = 1 − k^−c (c = 0.8), so the first step uses g² alone and no bias correction is needed;
- second moment v ← β2_k v + (1 − β2_k)(g² + ε1); "factored" keeps only its row and column
  means for matrices and rebuilds v = R Cᵀ / mean(R) (Shazeer & Stern, Alg. 4); PaLM did not
  factor;
- u = g / √v, then update clipping u ← u / max(1, RMS(u) / d) with d = 1;
- optional momentum m ← β1 m + (1 − β1) u, u = m (PaLM: β1 = 0.9);
- parameter scaling: the step is lr · max(ε2, RMS(param)) (PaLM: "Adam with parameter scaling");
- decoupled weight decay p ← p − wd · lr^power · p (PaLM: "dynamic weight decay of lr^2.0", i.e.
  wd = 1, power = 2), applied with the RMS taken before it.

Hand-written because ``torch.optim.Adafactor`` (checked in torch 2.13) always factors matrices,
has no first moment, caps the step at min(lr, 1/√k) internally (which fights an external LR
schedule), uses weight decay lr·wd only, and calls ``.item()`` per parameter (a host sync on
accelerators). Everything here stays in tensor ops, so it runs on DTensor (FSDP2/TP) shards: the
RMS reductions are global reductions of the DTensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from densetrain.errors import UserError


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.square().mean().sqrt()


class Adafactor(torch.optim.Optimizer):
    """PaLM-style Adafactor (see the module docstring for the update)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        *,
        beta1: float = 0.0,
        beta2_decay: float = 0.8,
        eps1: float = 1e-30,
        eps2: float = 1e-3,
        clip_threshold: float = 1.0,
        param_scaling: bool = True,
        factored: bool = False,
        weight_decay: float = 0.0,
        weight_decay_lr_power: float = 1.0,
    ) -> None:
        if lr <= 0 or not 0 <= beta1 < 1 or beta2_decay <= 0 or eps1 <= 0 or eps2 <= 0:
            raise UserError(
                f"Adafactor needs lr > 0, 0 <= beta1 < 1, beta2_decay > 0, eps1 > 0, eps2 > 0; "
                f"got lr={lr}, beta1={beta1}, beta2_decay={beta2_decay}, eps1={eps1}, eps2={eps2}"
            )
        defaults = dict(
            lr=lr, beta1=beta1, beta2_decay=beta2_decay, eps1=eps1, eps2=eps2,
            clip_threshold=clip_threshold, param_scaling=param_scaling, factored=factored,
            weight_decay=weight_decay, weight_decay_lr_power=weight_decay_lr_power,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _second_moment(self, state: dict, grad_sq: torch.Tensor, group: dict) -> torch.Tensor:
        one_minus_beta2 = float(state["step"]) ** -group["beta2_decay"]
        if group["factored"] and grad_sq.ndim >= 2:
            row_mean, col_mean = grad_sq.mean(dim=-1), grad_sq.mean(dim=-2)
            if "row" not in state:
                state["row"], state["col"] = torch.zeros_like(row_mean), torch.zeros_like(col_mean)
            state["row"].lerp_(row_mean, one_minus_beta2)
            state["col"].lerp_(col_mean, one_minus_beta2)
            row, col = state["row"], state["col"]
            row_share = row / row.mean(dim=-1, keepdim=True)
            return row_share.unsqueeze(-1) * col.unsqueeze(-2)
        if "variance" not in state:
            state["variance"] = torch.zeros_like(grad_sq)
        state["variance"].lerp_(grad_sq, one_minus_beta2)
        return state["variance"]

    def _update(self, param: torch.Tensor, group: dict) -> None:
        if param.grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients")
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        grad = param.grad.float()
        variance = self._second_moment(state, grad.square() + group["eps1"], group)
        update = grad * variance.rsqrt()
        if group["clip_threshold"] > 0:
            update = update / torch.clamp(_rms(update) / group["clip_threshold"], min=1.0)
        if group["beta1"] > 0:
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(update)
            state["momentum"].lerp_(update, 1 - group["beta1"])
            update = state["momentum"]
        lr = group["lr"]
        step_size = lr * torch.clamp(_rms(param.float()), min=group["eps2"]) if group[
            "param_scaling"] else lr
        if group["weight_decay"] != 0:
            param.mul_(1 - group["weight_decay"] * lr ** group["weight_decay_lr_power"])
        param.sub_((update * step_size).to(param.dtype))
