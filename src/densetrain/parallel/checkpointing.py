"""Activation checkpointing of transformer blocks: what each block keeps for backward.

Three modes (``parallel.activation_checkpointing``), defined tensor by tensor in
docs/parallelism.md ("What a block keeps"):

- "none": a block keeps what its backward reads. Under sequence parallelism that is the
  *sequence shard* of each matmul input: the all-gathered copy is made again in backward
  (Megatron-LM's sequence parallelism does the same), through the block policy below with no
  part recomputed. Otherwise the block runs as it is (autograd keeps what it keeps).
- "selective": the block policy below, recomputing the parts named by ``parallel.ac_recompute``
  (default: the norms and the MLP activation product, the cheap element-wise parts; Korthikanti
  et al. 2022 §4.3 recompute the attention core, which flash attention already keeps at its
  output and log-sum-exp).
- "full": a checkpointed block keeps only its input and recomputes everything in backward. Its
  blocks run aten matmuls (`densetrain.models.linear.aten_matmuls`), so torch's early stop of the
  recompute still skips the block's last matmul.

``ac_every=k`` applies the mode to every k-th block (a memory/compute dial); the other blocks
run as "none".

The block policy is torch's selective checkpoint (``create_selective_checkpoint_contexts``):
for each operator of the block's forward it says keep (its output is cached until backward) or
recompute. It keeps the outputs backward reads and nothing else:

- matmuls (QKV, MLP gate/up; up alone for GELU/ReLU): kept;
- row-parallel matmuls (attention output, MLP down projection): never kept, their output is a
  partial sum that only feeds a reduce-scatter (tensor parallel) or the residual add (an fp32
  CPU run's oneDNN linear keeps the MLP's: its recompute cannot stop before the matmul);
- the attention output's reduce-scatter or all-reduce (it feeds the MLP norm): kept;
- the MLP's reduce-scatter or all-reduce (only the residual add reads it): never kept;
- all-gathers (sequence parallel): never kept, gathered again in backward;
- the attention core (SDPA's output and log-sum-exp): kept unless "attention" is recomputed;
- norm outputs (`densetrain::rms_norm`, ``native_layer_norm``): kept unless "norms";
- the MLP activation (`densetrain::swiglu`, GELU, ReLU): kept unless "mlp_activation";
- everything else (RoPE, adds, casts, views): recomputed.

Without tensor parallelism the attention output projection's result is kept (the residual add
after it is recomputed from it).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from densetrain.errors import UserError
from densetrain.models.fused import FUSED_OPS
from densetrain.models.linear import ONEDNN_LINEAR_OP, aten_matmuls
from densetrain.parallel.config import DEFAULT_SELECTIVE_PARTS, check_recompute_parts

_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
}
_ONEDNN = set()
if ONEDNN_LINEAR_OP is not None:  # densetrain.models.linear's CPU matmuls (eager, compiled)
    _ONEDNN = {ONEDNN_LINEAR_OP.default, torch.ops.densetrain.onednn_mm.default}
    _MATMULS |= _ONEDNN

_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
_RMS_NORM, _SWIGLU = FUSED_OPS
_NORMS = {_RMS_NORM, torch.ops.aten.native_layer_norm.default}
_ACTIVATIONS = {_SWIGLU, torch.ops.aten.gelu.default, torch.ops.aten.relu.default}


def _functional(name: str):
    ops = getattr(torch.ops, "_c10d_functional", None)
    return getattr(ops, name).default if ops is not None and hasattr(ops, name) else None


_KEPT_COLLECTIVES = {op for op in (_functional("reduce_scatter_tensor"),
                                   _functional("all_reduce")) if op is not None}


class BlockPolicy:
    """The keep-or-recompute decision for each operator of one block's forward (list above).

    ``recompute``: the parts recomputed (`parallel.config.RECOMPUTE_PARTS`);
    ``tensor_parallel``: whether the block's row-parallel matmuls feed a collective (then
    their output is never kept). It knows which matmul is row-parallel from forward hooks on
    the block's ``attn.wo`` and ``mlp.w_down``, which run again in the recompute."""

    def __init__(self, block: nn.Module, *, recompute: Iterable[str],
                 tensor_parallel: bool) -> None:
        self.recompute = frozenset(recompute)
        self.tensor_parallel = tensor_parallel
        self._inside: str | None = None
        never_kept = {"w_down"} | ({"wo"} if tensor_parallel else set())
        for name, module in (("wo", block.attn.wo), ("w_down", block.mlp.w_down)):
            if name in never_kept:
                module.register_forward_pre_hook(self._enter(name))
                module.register_forward_hook(self._leave)

    def _enter(self, name: str):
        def hook(module, args) -> None:
            self._inside = name
        return hook

    def _leave(self, module, args, output) -> None:
        self._inside = None

    def keeps(self, op) -> bool:
        """Whether ``op``'s output is kept for backward."""
        if op in _MATMULS:
            # oneDNN's linear (fp32 CPU runs) saves its input inside an autograd Function, after
            # its matmul: the recompute cannot stop before it, so its output is kept instead
            return self._inside is None or (op in _ONEDNN and not self.tensor_parallel)
        if op in _KEPT_COLLECTIVES:
            # the attention output's reduction feeds the MLP norm; the MLP's only the residual
            return self._inside == "wo"
        return _part_kept(op, self.recompute)

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if self.keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts(self):
        """The forward and recompute contexts of torch's selective checkpoint."""
        return create_selective_checkpoint_contexts(self)


def _full_contexts():
    return aten_matmuls(), aten_matmuls()


def _part_kept(op, recompute) -> bool:
    """Whether ``op``'s output is kept as one of a block's parts (attention core, norms, MLP
    activation) that ``recompute`` may name; any other operator's is not."""
    for ops, part in ((_ATTENTION, "attention"), (_NORMS, "norms"),
                      (_ACTIVATIONS, "mlp_activation")):
        if op in ops:
            return part not in recompute
    return False


def _compiled_block_contexts(recompute: tuple[str, ...]):
    """The policy of a block that ``torch.compile`` will trace: by operator alone (torch.compile
    takes a checkpoint's ``context_fn`` only as a function or a partial of constants, and a
    compiled graph runs no module hooks), every matmul kept; inductor's partitioner chooses the
    rest of what to save."""
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        keep = op in _MATMULS or _part_kept(op, recompute)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str, *, every: int = 1,
                                   recompute: Iterable[str] | None = None,
                                   tensor_parallel: bool = False,
                                   sequence_parallel: bool = False,
                                   compiled: bool = False) -> nn.Module:
    """Wrap blocks of ``model.layers`` in place; ``mode`` is "none", "full" or "selective".

    ``recompute``: the parts "selective" recomputes (None: `DEFAULT_SELECTIVE_PARTS`);
    ``tensor_parallel``/``sequence_parallel``: the blocks' layout (with sequence parallelism
    "none" still wraps every block, to keep sequence shards instead of gathered inputs);
    ``compiled``: the blocks will run under ``torch.compile`` (`_compiled_block_contexts`). Block
    names are kept (the wrapper's inner name is dropped from parameter names by the model's init
    and by checkpoints' canonical names).
    """
    if mode not in ("none", "full", "selective"):
        raise UserError(f"activation_checkpointing must be none|full|selective, got {mode!r}")
    if every < 1:
        raise UserError(f"ac_every must be >= 1, got {every}")
    parts = DEFAULT_SELECTIVE_PARTS if recompute is None or not list(recompute) else recompute
    check_recompute_parts(parts)
    sharded_inputs = tensor_parallel and sequence_parallel
    for position, (name, block) in enumerate(list(model.layers.items())):
        block_mode = mode if position % every == 0 else "none"
        if block_mode == "full":
            model.layers[name] = checkpoint_wrapper(block, context_fn=_full_contexts,
                                                    preserve_rng_state=True)
        elif block_mode == "selective" or sharded_inputs:
            kept_parts = tuple(parts) if block_mode == "selective" else ()
            if compiled:
                context_fn = partial(_compiled_block_contexts, kept_parts)
            else:
                context_fn = BlockPolicy(block, recompute=kept_parts,
                                         tensor_parallel=tensor_parallel).contexts
            model.layers[name] = checkpoint_wrapper(block, context_fn=context_fn,
                                                    preserve_rng_state=True)
    return model
