"""Next-token choice: greedy, temperature, top-k and top-p (nucleus, Holtzman et al. 2020).

Shape legend: B batch, V vocab, S sequence.
"""

from __future__ import annotations

import numbers

import torch

from densetrain.errors import UserError
from densetrain.generate.kv_cache import KVCache


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, *,
                   names: tuple[str, str, str] = ("temperature", "top_k", "top_p")) -> None:
    """Raise ``ValueError`` naming the argument (as ``names`` spell them: the CLI's flags)
    unless ``temperature`` >= 0, ``top_k`` is a positive integer or None and ``top_p`` is in
    (0, 1] or None (None: no such limit). Checked before the first token, so a bad value fails
    even where greedy decoding (temperature 0) would not read it."""
    temperature_name, top_k_name, top_p_name = names
    if not temperature >= 0:  # also NaN
        raise UserError(f"{temperature_name} must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool)
                              or not isinstance(top_k, numbers.Integral) or top_k <= 0):
        raise UserError(f"{top_k_name} must be a positive integer (unset: no limit), "
                        f"got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"{top_p_name} must be in (0, 1] (unset: no limit), got {top_p}")


def filter_logits(
    logits_BV: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Set logits outside the top-k and outside the nucleus of mass ``top_p`` to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token is always kept.
    """
    check_sampling(0.0, top_k, top_p)
    logits_BV = logits_BV.float()
    if top_k is not None:
        k = min(top_k, logits_BV.shape[-1])
        kth_B1 = torch.topk(logits_BV, k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_next(
    logits_BV: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [B]: argmax when ``temperature`` is 0, else a draw from
    softmax(filtered logits / temperature)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    filtered_BV = filter_logits(logits_BV / temperature, top_k=top_k, top_p=top_p)
    probs_BV = torch.softmax(filtered_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokens_BS: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue the prompts ``tokens_BS`` (equal lengths) by up to ``max_new_tokens`` tokens.

    The prompt is run once through a ``KVCache`` and each new token costs one incremental step.
    Greedy by default; ``temperature`` > 0 samples, optionally restricted by ``top_k``/``top_p``.
    After a sequence emits ``eos_token_id`` it is padded with it; generation stops early when
    every sequence has finished. Returns [B, S + generated].
    """
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    if tokens_BS.dim() != 2 or 0 in tokens_BS.shape:
        raise UserError(
            "tokens_BS must be [batch, prompt length] with at least one prompt of at least "
            f"one token, got shape {list(tokens_BS.shape)}"
        )
    cfg = model.config
    batch, prompt_len = tokens_BS.shape
    total = prompt_len + max_new_tokens
    if cfg.position_embedding == "learned" and total > cfg.max_seq_len:
        raise UserError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
            f"{cfg.max_seq_len} of a model with learned positions"
        )
    was_training = model.training
    model.eval()
    dtype = next(model.parameters()).dtype
    cache = KVCache(cfg, batch_size=batch, max_len=total, device=tokens_BS.device, dtype=dtype)
    positions_BS = torch.arange(prompt_len, device=tokens_BS.device).unsqueeze(0)
    step_input_BS = tokens_BS
    out_BS = tokens_BS
    finished_B = torch.zeros(batch, dtype=torch.bool, device=tokens_BS.device)
    for _ in range(max_new_tokens):
        logits_BSV = model(step_input_BS, positions_BS=positions_BS, kv_cache=cache)
        next_B = sample_next(
            logits_BSV[:, -1],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
        )
        if eos_token_id is not None:
            next_B = torch.where(finished_B, torch.full_like(next_B, eos_token_id), next_B)
            finished_B |= next_B == eos_token_id
        out_BS = torch.cat([out_BS, next_B.unsqueeze(1)], dim=1)
        if eos_token_id is not None and bool(finished_B.all()):
            break
        step_input_BS = next_B.unsqueeze(1)
        positions_BS = positions_BS[:, -1:] + 1
    model.train(was_training)
    return out_BS
