"""Activation checkpointing of transformer blocks.

- "full": each checkpointed block keeps only its input and recomputes everything in backward;
  ``ac_every=k`` checkpoints every k-th block (a memory/compute dial). Its blocks run aten
  matmuls (`densetrain.models.linear.aten_matmuls`), so torch's early stop of the recompute
  still skips the block's last matmul.
- "selective": the block's matmul outputs (the expensive ops) are saved and the cheap
  element-wise ops (norms, activations, softmax inputs, RoPE) are recomputed — the spirit of
  Korthikanti et al. 2022 §4.3, expressed with torch's selective-checkpoint policy.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from densetrain.errors import UserError
from densetrain.models.linear import ONEDNN_LINEAR_OP, aten_matmuls

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
if ONEDNN_LINEAR_OP is not None:  # densetrain.models.linear's CPU matmuls (eager, compiled)
    _SAVED_OPS.add(ONEDNN_LINEAR_OP.default)
    _SAVED_OPS.add(torch.ops.densetrain.onednn_mm.default)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _full_contexts():
    return aten_matmuls(), aten_matmuls()


def apply_activation_checkpointing(model: nn.Module, mode: str, *, every: int = 1) -> nn.Module:
    """Wrap blocks of ``model.layers`` in place; ``mode`` is "none", "full" or "selective".

    Block names are kept (the wrapper's inner name is dropped from parameter names by the
    model's init and by checkpoints' canonical names).
    """
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise UserError(f"activation_checkpointing must be none|full|selective, got {mode!r}")
    if every < 1:
        raise UserError(f"ac_every must be >= 1, got {every}")
    for position, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" and position % every != 0:
            continue
        if mode == "full":
            wrapped = checkpoint_wrapper(block, context_fn=_full_contexts,
                                         preserve_rng_state=True)
        else:
            wrapped = checkpoint_wrapper(
                block, context_fn=partial(_selective_contexts), preserve_rng_state=True
            )
        model.layers[name] = wrapped
    return model
