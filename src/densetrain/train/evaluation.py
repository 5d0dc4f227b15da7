"""Validation loss and the sample continuation, through the `LaidOutModel` interface (the same
code under every layout: pipeline, tensor and context parallel included)."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from densetrain.train.state import RunParts


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of ``value`` over every rank (a collective; the value itself on one process)."""
    value = value.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


class Evaluator:
    """Validation loss every ``interval`` steps and after the last step (``interval`` 0: never),
    over ``num_batches`` fixed validation batches."""

    def __init__(self, *, interval: int, num_batches: int) -> None:
        self.interval = interval
        self.num_batches = num_batches

    def due(self, step: int, total_steps: int) -> bool:
        """True on the cadence and at the last step."""
        return self.interval > 0 and (step % self.interval == 0 or step >= total_steps)

    @torch.no_grad()
    def evaluate(self, parts: RunParts) -> dict[str, float]:
        """``{"val_loss", "val_ppl"}`` averaged over the ranks (empty without validation data)."""
        if parts.data.val is None or self.interval <= 0:
            return {}
        # Batches of the training global batch size: valid on every layout, so every layout
        # evaluates the same validation sequences.
        rows = parts.training.global_batch_size
        total = torch.zeros((), device=parts.device)
        for batch in parts.data.val.iter_eval(self.num_batches, rows):
            prepared = parts.model.prepare_batch(batch, parts.device)
            total += parts.model.eval_loss(prepared, autocast=parts.autocast,
                                           micro_batch_size=parts.training.micro_batch_size)
        val_loss = mean_over_ranks(total / self.num_batches)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


@torch.no_grad()
def sample_text(parts: RunParts, prompt: str, max_new_tokens: int) -> str:
    """Greedy KV-cached continuation of ``prompt`` by the run's model, on rank 0 ("" elsewhere).

    A collective: every rank takes part in gathering the full weights of a sharded or pipelined
    model; one process generates from its own module directly.
    """
    from densetrain.generate import generate
    from densetrain.models import Transformer

    tokenizer = parts.data.tokenizer
    if parts.world_size == 1:
        model = parts.model.module
    else:
        weights = parts.model.gathered_state_dict()
        if not parts.is_main:
            return ""
        model = Transformer(parts.model_cfg).to(parts.device)
        model.load_state_dict({k: v.to(parts.device) for k, v in weights.items()})
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    tokens_1S = torch.tensor([ids], dtype=torch.long, device=parts.device)
    model.eval()
    try:
        with parts.autocast():
            out_1T = generate(model, tokens_1S, max_new_tokens, eos_token_id=tokenizer.eos_id)
    finally:
        model.train()
    text = tokenizer.decode(out_1T[0, len(ids):].tolist())
    if parts.is_main:
        print(f"sample (greedy) | {prompt!r} ->\n{prompt}{text}\n", file=sys.stderr)
    return text
