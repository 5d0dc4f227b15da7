"""Serving cost of a model: FLOPs per token, KV-cache bytes, and roofline bounds on decoding.

Counts follow ``models.sizing`` (no torch, no model built):

- forward FLOPs per token = 2·``matmul_params`` + 4·L·H·Q·keys (QKᵀ and AV, 2 FLOPs per
  multiply-add; the forward third of PaLM's 6N + 12·L·H·Q·T, Chowdhery et al. 2022 App. B).
  Prefill averages ``keys`` over the causal positions of the prompt; a decode step at context
  length S attends min(S, window) keys.
- KV cache: ``sizing.kv_cache_bytes_per_token`` (2·L·G·Q bytes per element: MHA G = H, GQA
  G < H, MQA G = 1) times the slots a sequence holds: the whole context, or the last
  ``sliding_window`` positions in densetrain's rolling buffer (Jiang et al. 2023, Mistral 7B §2).
- Decoding one token for each of b sequences reads every weight once and each sequence's cache
  (Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2): the step takes at least
  bytes / (devices · HBM bandwidth) and b · FLOPs / (devices · peak); tokens/s is b over the
  larger (a roofline upper bound: no kernel reaches either peak).
- Largest batch: what is left of ``memory_fraction`` of device memory after the weights, over
  the cache of one sequence (activations and workspace are not counted; 0.9 is vLLM's default
  ``gpu_memory_utilization``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from densetrain.errors import UserError
from densetrain.models import sizing
from densetrain.models.config import ModelConfig
from densetrain.planner.hardware import ClusterSpec
from densetrain.values import is_int_at_least


@dataclass(frozen=True, kw_only=True)
class ServingSetup:
    """How the model is served: sequence length, batch, dtypes and devices."""

    context_len: int
    """Tokens per sequence when decoding ends (prompt + generated)."""
    prompt_len: int | None = None
    """Prompt length for the prefill count (default: ``context_len``)."""
    batch_size: int = 1
    kv_bytes_per_elem: int = 2
    weight_bytes_per_param: float = 2.0
    devices: int = 1
    """Devices sharing the model (tensor parallel): their memory and bandwidth add up."""
    memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        for name in ("context_len", "batch_size", "kv_bytes_per_elem", "devices"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise UserError(f"serving {name} must be a positive integer, got {value!r}")
        if self.prompt_len is not None and not 0 < self.prompt_len <= self.context_len:
            raise UserError(f"serving prompt_len must be in 1..context_len "
                            f"({self.context_len}), got {self.prompt_len!r}")
        if not (math.isfinite(self.weight_bytes_per_param) and self.weight_bytes_per_param > 0):
            raise UserError(f"serving weight_bytes_per_param must be > 0, "
                            f"got {self.weight_bytes_per_param!r}")
        if not 0 < self.memory_fraction <= 1:
            raise UserError(f"serving memory_fraction must be in (0, 1], "
                            f"got {self.memory_fraction!r}")


@dataclass(frozen=True, kw_only=True)
class ServingCost:
    """Per-token and per-step serving costs of one model under one ``ServingSetup``."""

    prefill_flops_per_token: float
    decode_flops_per_token: float
    kv_bytes_per_token: int
    kv_slots_per_sequence: int
    kv_bytes_per_sequence: int
    weight_bytes: float
    decode_bytes_per_step: float
    decode_memory_bound_tokens_per_s: float
    decode_compute_bound_tokens_per_s: float
    max_batch: int

    @property
    def decode_tokens_per_s(self) -> float:
        """The roofline bound: the lower of the memory and compute bounds."""
        return min(self.decode_memory_bound_tokens_per_s, self.decode_compute_bound_tokens_per_s)

    def as_dict(self) -> dict:
        """Plain dict, the bound included."""
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s}


def kv_slots(cfg: ModelConfig, context_len: int) -> int:
    """Positions a sequence of ``context_len`` tokens keeps in the cache (rolling buffer of
    ``sliding_window`` slots when the window is shorter)."""
    if cfg.sliding_window is None:
        return context_len
    return min(context_len, cfg.sliding_window)


def forward_flops_per_token(cfg: ModelConfig, keys: float) -> float:
    """Forward FLOPs of one token that attends ``keys`` keys: 2·matmul params + 4·L·H·Q·keys."""
    return 2.0 * sizing.matmul_params(cfg) + 4.0 * cfg.num_layers * cfg.q_dim * keys


def mean_causal_keys(cfg: ModelConfig, prompt_len: int) -> float:
    """Mean over positions p = 1..P of min(p, window): keys a prompt token attends."""
    window = cfg.sliding_window or prompt_len
    w = min(window, prompt_len)
    total = w * (w + 1) / 2 + (prompt_len - w) * w
    return total / prompt_len


def serving_cost(cfg: ModelConfig, cluster: ClusterSpec, setup: ServingSetup) -> ServingCost:
    """Serving costs of ``cfg`` on ``setup.devices`` devices of ``cluster`` (see module doc)."""
    kv_token = sizing.kv_cache_bytes_per_token(cfg, setup.kv_bytes_per_elem)
    slots = kv_slots(cfg, setup.context_len)
    kv_sequence = kv_token * slots
    weights = sizing.param_counts(cfg).total * setup.weight_bytes_per_param
    decode_flops = forward_flops_per_token(cfg, slots)
    batch = setup.batch_size
    step_bytes = weights + batch * kv_sequence
    bandwidth = setup.devices * cluster.hbm_bytes_per_s
    flops_rate = setup.devices * cluster.peak_flops
    free = setup.devices * cluster.memory_bytes * setup.memory_fraction - weights
    return ServingCost(
        prefill_flops_per_token=forward_flops_per_token(
            cfg, mean_causal_keys(cfg, setup.prompt_len or setup.context_len)),
        decode_flops_per_token=decode_flops,
        kv_bytes_per_token=kv_token,
        kv_slots_per_sequence=slots,
        kv_bytes_per_sequence=kv_sequence,
        weight_bytes=weights,
        decode_bytes_per_step=step_bytes,
        decode_memory_bound_tokens_per_s=batch * bandwidth / step_bytes,
        decode_compute_bound_tokens_per_s=flops_rate / decode_flops,
        max_batch=max(0, int(free // kv_sequence)),
    )


def format_serving(cost: ServingCost, cluster: ClusterSpec, setup: ServingSetup) -> list[tuple]:
    """(label, value) rows for ``densetrain model-info --serve``."""
    gb = 1e9
    where = f"{setup.devices} x {cluster.name}"
    fit = (f"{cost.max_batch:,} sequences of {setup.context_len} tokens" if cost.max_batch
           else f"none: weights ({cost.weight_bytes / gb:.1f} GB) exceed "
                f"{setup.memory_fraction:.0%} of {where} memory")
    bound = (f"<= {cost.decode_tokens_per_s:,.0f} (memory bound "
             f"{cost.decode_memory_bound_tokens_per_s:,.0f}, compute bound "
             f"{cost.decode_compute_bound_tokens_per_s:,.0f})")
    if setup.batch_size > cost.max_batch:
        bound += f"; not reachable: batch {setup.batch_size} does not fit (see largest batch)"
    return [
        ("serving on", f"{where} ({cluster.hbm_bytes_per_s / 1e12:.2f} TB/s HBM, "
                       f"{cluster.peak_flops / 1e12:.0f} TFLOP/s each), batch "
                       f"{setup.batch_size}, context {setup.context_len}"),
        ("prefill FLOPs/token", f"{cost.prefill_flops_per_token:.4g} (causal mean over "
                                f"{setup.prompt_len or setup.context_len} tokens)"),
        ("decode FLOPs/token", f"{cost.decode_flops_per_token:.4g} (at context "
                               f"{setup.context_len})"),
        ("KV cache/sequence", f"{cost.kv_bytes_per_sequence:,} bytes ({cost.kv_slots_per_sequence}"
                              f" slots x {cost.kv_bytes_per_token:,} bytes)"),
        ("weights", f"{cost.weight_bytes / gb:.2f} GB at {setup.weight_bytes_per_param:g} "
                    "bytes/param"),
        ("decode bytes/step", f"{cost.decode_bytes_per_step / gb:.3f} GB (weights + batch KV)"),
        ("decode tokens/s", bound),
        ("largest batch", fit),
    ]
