"""`densetrain plan --calibrate`: measure this machine and write it as a cluster entry.

- GEMMs: square matmuls of sides 64 ... 1024 (and larger while they stay quick) in the run's
  dtype; the rate falls for small sides as r(s) = R s / (s + h), so 1/r is linear in 1/s and a
  least-squares line gives the asymptote R (written as ``peak_tflops`` with
  ``gemm_efficiency = 1``: a CPU has no data-sheet peak) and the half-rate side ``h``.
- Memory bandwidth: a copy of a 256 MB tensor (read + write).
- Attention: SDPA forward + backward at a moderate shape, its causal FLOPs over the peak.
- Collectives: all-reduce over ``ranks`` local gloo processes for payloads of 1-32 MB; the bus
  bandwidth is 2(n-1)/n x size / time (the ring factor the planner uses), latency from a
  4-byte all-reduce. There is one node, so the inter-node figures repeat the intra-node ones.

Every figure is the median of several repeats. A calibration that cannot run its ranks (or
runs past its timeout) raises ``RuntimeError`` saying so.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_sweep(sides=(64, 128, 256, 512, 768, 1024), dtype_name: str = "float32"):
    """[(side, FLOP/s)] of square matmuls."""
    import torch

    dtype = getattr(torch, dtype_name)
    out = []
    for side in sides:
        a = torch.randn(side, side, dtype=dtype)
        b = torch.randn(side, side, dtype=dtype)
        seconds = _median_seconds(lambda a=a, b=b: torch.mm(a, b))
        out.append((side, 2.0 * side**3 / seconds))
    return out


def fit_gemm_curve(sweep) -> tuple[float, float]:
    """(asymptotic rate R, half-rate side h) of r(s) = R s / (s + h) by least squares on
    1/r = 1/R + (h/R)(1/s)."""
    xs = [1.0 / s for s, _ in sweep]
    ys = [1.0 / r for _, r in sweep]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
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


def _collective_rank(rank: int, world_size: int, sizes_mb: tuple[int, ...]) -> dict:
    import torch
    import torch.distributed as dist

    out = {}
    for mb in sizes_mb:
        buf = torch.ones(mb * 2**20 // 4)
        dist.barrier()
        out[mb] = _median_seconds(lambda buf=buf: dist.all_reduce(buf), repeats=3)
    tiny = torch.ones(1)
    out[0] = _median_seconds(lambda: dist.all_reduce(tiny), repeats=20)
    return out


def collective_figures(ranks: int, timeout_s: float = 120.0,
                       sizes_mb: tuple[int, ...] = (1, 8, 32)) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of gloo all-reduce between ``ranks`` local processes."""
    from densetrain.testing import run_distributed

    if ranks < 2:
        raise ValueError(f"--calibrate-ranks must be >= 2 to measure collectives, got {ranks}")
    try:
        results = run_distributed(_collective_rank, ranks, sizes_mb, timeout=timeout_s)
    except Exception as e:  # a rank that fails or hangs: say why, no partial entry
        raise RuntimeError(f"collective calibration on {ranks} local gloo ranks failed: {e}") from e
    times = {mb: max(r[mb] for r in results) for mb in (*sizes_mb, 0)}
    ring = 2.0 * (ranks - 1) / ranks
    bandwidth = statistics.median(ring * mb * 2**20 / times[mb] for mb in sizes_mb)
    latency = times[0] / (2 * math.ceil(math.log2(ranks)))
    return bandwidth, latency


def calibrate(path: str | Path, *, ranks: int = 2, name: str = "this-machine",
              timeout_s: float = 120.0) -> tuple[Path, dict]:
    """Measure this machine and write ``[clusters.<name>]`` to ``path`` atomically."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or ranks) // ranks))
    rate, half = fit_gemm_curve(gemm_sweep())
    bandwidth, latency = collective_figures(ranks, timeout_s)
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    entry = {
        "peak_tflops": rate / 1e12, "gemm_efficiency": 1.0, "gemm_half_dim": half,
        "attention_efficiency": min(1.0, attention_rate() / rate),
        "memory_gb": total_memory / ranks / 1e9, "hbm_tb_s": memory_bandwidth() / 1e12,
        "devices_per_node": ranks, "intra_node_gb_s": bandwidth / 1e9,
        "inter_node_gb_s": bandwidth / 1e9, "intra_node_latency_us": latency * 1e6,
        "inter_node_latency_us": latency * 1e6,
        "description": f"measured: {ranks} local processes, gloo, float32, "
                       f"{torch.get_num_threads()} threads each",
    }
    lines = [f"[clusters.{name}]"] + [
        f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v:.6g}" for k, v in entry.items()]
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, target)
    from densetrain.planner.hardware import load_cluster_file

    load_cluster_file(target)  # the entry it wrote must be one the planner accepts
    return target, entry
