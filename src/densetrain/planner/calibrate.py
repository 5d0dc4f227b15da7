"""`densetrain plan --calibrate`: measure this machine and write it as a cluster entry.

- GEMMs: (2048 x s) @ (s x 2048) matmuls for s = 64 ... 1024 in the run's dtype: the smallest
  side is s and the others are large, which is what the planner's efficiency curve reads; the
  rate falls for small sides as r(s) = R s / (s + h), so 1/r is linear in 1/s and a
  least-squares line gives the asymptote R (written as ``peak_tflops`` with
  ``gemm_efficiency = 1``: a CPU has no data-sheet peak) and the half-rate side ``h``.
- Memory bandwidth: a copy of a 256 MB tensor (read + write).
- Attention: SDPA forward + backward at a moderate shape, its causal FLOPs over the peak.
- Collectives: all-reduce over ``ranks`` local gloo processes for payloads of 64 KiB - 16 MiB,
  fitted as time = alpha + 2(n-1)/n x S / B (Hockney's alpha-beta model, with the ring factor
  the planner uses): B is the link bandwidth, alpha the fixed cost of a call, written as the
  latency of each of the planner's 2 log2(n) steps. There is one node, so the inter-node
  figures repeat the intra-node ones.
- Host time per layer: forward + backward, and an AdamW step, of 3- and 1-layer models too
  narrow (width 16 per rank) to compute anything, the difference halved: eager dispatch per
  layer and microbatch (and per layer and optimizer step), alone, with tensor parallelism
  (DTensor's dispatch) and with FSDP2 (its hooks and copies), the fixed cost of the
  collectives taken out as the planner counts them. On a GPU the host runs ahead of the device
  and this is hidden; on a CPU it is part of the step.

Every figure is the median of several repeats. A calibration that cannot run its ranks (or
runs past its timeout) raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from pathlib import Path

from densetrain.errors import UserError


def _median_seconds(fn, repeats: int = 5, pick=statistics.median) -> float:
    """``pick`` (the median) of ``repeats`` timed calls of ``fn``, after a warm-up call.

    The host overheads, a difference of two small times, take ``pick=min``: other work on a
    shared host only ever adds time, and a median of a few calls can make the difference come
    out negative."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)


def gemm_sweep(sides=(64, 128, 256, 512, 768, 1024), dtype_name: str = "float32",
               rows: int = 2048):
    """[(side, FLOP/s)] of (rows x side) @ (side x rows) matmuls."""
    import torch

    dtype = getattr(torch, dtype_name)
    out = []
    for side in sides:
        a = torch.randn(rows, side, dtype=dtype)
        b = torch.randn(side, rows, dtype=dtype)
        seconds = _median_seconds(lambda a=a, b=b: torch.mm(a, b))
        out.append((side, 2.0 * rows * side * rows / seconds))
    return out


def _line_fit(points) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through [(x, y)]."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points)
    return slope, mean_y - slope * mean_x


def fit_gemm_curve(sweep) -> tuple[float, float]:
    """(asymptotic rate R, half-rate side h) of r(s) = R s / (s + h) by least squares on
    1/r = 1/R + (h/R)(1/s)."""
    slope, intercept = _line_fit([(1.0 / s, 1.0 / r) for s, r in sweep])
    if intercept <= 0:  # the rate still rises at the largest side: take the best measured one
        best = max(r for _, r in sweep)
        return best, max(slope * best, 1.0)
    rate = 1.0 / intercept
    return rate, max(slope * rate, 1.0)


def memory_bandwidth(megabytes: int = 256) -> float:
    """Bytes/s of a large tensor copy (read + write)."""
    import torch

    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src))


def attention_rate(batch: int = 2, heads: int = 8, seq: int = 512, head_dim: int = 64) -> float:
    """Causal FLOP/s of SDPA forward + backward (PaLM counting halved by the mask)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3.5 * 4.0 * batch * heads * seq * seq * head_dim * 0.5
    return flops / _median_seconds(step, repeats=3)


def _collective_rank(rank: int, world_size: int, sizes_kib: tuple[int, ...]) -> dict:
    import torch
    import torch.distributed as dist

    warm = torch.ones(2**18)
    for _ in range(5):  # the first calls of a group set up its connections
        dist.all_reduce(warm)
    out = {}
    for kib in sizes_kib:
        buf = torch.ones(kib * 2**10 // 4)
        dist.barrier()
        out[kib] = _median_seconds(lambda buf=buf: dist.all_reduce(buf), repeats=7)
    return out


def fit_alpha_beta(points) -> tuple[float, float]:
    """(bandwidth B, fixed cost alpha) of time = alpha + bytes / B by least squares over
    [(bytes, seconds)] (Hockney's model of a message)."""
    slope, intercept = _line_fit(points)
    if slope <= 0:
        raise RuntimeError(f"collective times do not grow with the payload: {points}")
    return 1.0 / slope, max(intercept, 0.0)


def collective_figures(ranks: int, timeout_s: float = 120.0,
                       sizes_kib: tuple[int, ...] = (64, 256, 1024, 4096, 16384),
                       ) -> tuple[float, float]:
    """(bus bandwidth bytes/s, fixed cost per call s) of gloo all-reduce between ``ranks``
    local processes: time = alpha + 2(n-1)/n x payload / bandwidth, fitted over the payloads."""
    from densetrain.testing import run_distributed

    if ranks < 2:
        raise UserError(f"--calibrate-ranks must be >= 2 to measure collectives, got {ranks}")
    try:
        results = run_distributed(_collective_rank, ranks, sizes_kib, timeout=timeout_s)
    except Exception as e:  # a rank that fails or hangs: say why, no partial entry
        raise RuntimeError(f"collective calibration on {ranks} local gloo ranks failed: {e}") from e
    ring = 2.0 * (ranks - 1) / ranks
    return fit_alpha_beta([(ring * kib * 2**10, max(r[kib] for r in results))
                           for kib in sizes_kib])


HOST_MODES = ("plain", "tp", "fsdp")
"""How the narrow models of the host-time calibration are laid out: alone on each rank, tensor
parallel with sequence parallel over all ranks, FSDP2 per layer over all ranks."""


def _layer_host_rank(rank: int, world_size: int, repeats: int) -> dict:
    """Per layer, for each of ``HOST_MODES``: seconds of a forward + backward and of an AdamW
    step, for 3- and 1-layer models too narrow to compute anything (the difference, halved)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from densetrain.models.config import ModelConfig
    from densetrain.models.transformer import Transformer
    from densetrain.parallel.fsdp import apply_fsdp
    from densetrain.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    tokens = torch.randint(0, 64, (1, 8 * world_size))
    # FSDP2 warns that the root returns a view (the logits); nothing here writes to it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    out = {}
    for mode in HOST_MODES:
        seconds = {}
        for layers in (1, 3):
            torch.manual_seed(0)
            cfg = ModelConfig(vocab_size=64 * world_size, dim=16 * world_size, num_layers=layers,
                              num_heads=2 * world_size, num_kv_heads=world_size,
                              ffn_dim=32 * world_size, max_seq_len=tokens.shape[1])
            model = Transformer(cfg)
            if mode == "tp":
                apply_tensor_parallel(model, mesh, sequence_parallel=True)
            elif mode == "fsdp":
                apply_fsdp(model, mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def backward(model=model):
                model(tokens).float().sum().backward()

            def update(optimizer=optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)

            seconds[layers] = (_median_seconds(backward, repeats=repeats, pick=min),
                               _median_seconds(update, repeats=repeats, pick=min))
        out[mode] = tuple((seconds[3][k] - seconds[1][k]) / 2 for k in (0, 1))
    return out


def layer_host_seconds(ranks: int, alpha: float, timeout_s: float = 120.0,
                       repeats: int = 7) -> dict[str, tuple[float, float]]:
    """Host seconds per layer for each of ``HOST_MODES``: (per microbatch's forward + backward,
    per optimizer step), the eager dispatch (and DTensor's, and FSDP2's hooks and copies) a
    narrow model spends beyond its FLOPs. The fixed cost of the collectives the planner
    already counts per layer and microbatch (``alpha`` each, from ``collective_figures``;
    ``comm.TP_CALLS_PER_LAYER`` under tp, ``comm.FSDP_CALLS_PER_LAYER`` under FSDP) is left
    out."""
    from densetrain.planner.comm import FSDP_CALLS_PER_LAYER, TP_CALLS_PER_LAYER
    from densetrain.testing import run_distributed

    try:
        results = run_distributed(_layer_host_rank, ranks, repeats, timeout=timeout_s)
    except Exception as e:  # a rank that fails or hangs: say why, no partial entry
        raise RuntimeError(f"host-overhead calibration on {ranks} local gloo ranks failed: "
                           f"{e}") from e
    counted = {"plain": 0, "tp": TP_CALLS_PER_LAYER, "fsdp": FSDP_CALLS_PER_LAYER}
    return {mode: (max(max(r[mode][0] for r in results) - counted[mode] * alpha, 0.0),
                   max(max(r[mode][1] for r in results), 0.0)) for mode in HOST_MODES}


def calibrate(path: str | Path, *, ranks: int = 2, name: str = "this-machine",
              timeout_s: float = 120.0) -> tuple[Path, dict]:
    """Measure this machine and write ``[clusters.<name>]`` to ``path`` atomically."""
    import torch

    if ranks < 2:  # said before anything is measured
        raise UserError(f"--calibrate-ranks must be >= 2 to measure collectives, got {ranks}")

    torch.set_num_threads(max(1, (os.cpu_count() or ranks) // ranks))
    rate, half = fit_gemm_curve(gemm_sweep())
    bandwidth, alpha = collective_figures(ranks, timeout_s)
    latency = alpha / (2 * math.ceil(math.log2(ranks)))  # the planner's 2 log2(n) steps a call
    host = layer_host_seconds(ranks, alpha, timeout_s)
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    entry = {
        "peak_tflops": rate / 1e12, "gemm_efficiency": 1.0, "gemm_half_dim": half,
        "attention_efficiency": min(1.0, attention_rate() / rate),
        "memory_gb": total_memory / ranks / 1e9, "hbm_tb_s": memory_bandwidth() / 1e12,
        "devices_per_node": ranks, "intra_node_gb_s": bandwidth / 1e9,
        "inter_node_gb_s": bandwidth / 1e9, "intra_node_latency_us": latency * 1e6,
        "inter_node_latency_us": latency * 1e6,
        "layer_host_us": host["plain"][0] * 1e6, "tp_layer_host_us": host["tp"][0] * 1e6,
        "fsdp_layer_host_us": host["fsdp"][0] * 1e6,
        "optimizer_layer_host_us": host["plain"][1] * 1e6,
        "tp_optimizer_layer_host_us": host["tp"][1] * 1e6,
        "fsdp_optimizer_layer_host_us": host["fsdp"][1] * 1e6,
        "description": f"measured: {ranks} local processes, gloo, float32, "
                       f"{torch.get_num_threads()} threads each",
    }
    lines = [f"[clusters.{name}]"] + [
        f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v:.6g}" for k, v in entry.items()]
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    from densetrain.planner.hardware import load_cluster_file

    try:
        load_cluster_file(tmp)  # the entry must be one the planner accepts before it is kept
    except ValueError:
        tmp.unlink()
        raise
    os.replace(tmp, target)
    return target, entry
