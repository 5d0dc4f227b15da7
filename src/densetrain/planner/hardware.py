"""Accelerators and clusters: peak FLOP/s, memory, and the bandwidths the step-time model uses.

A ``ClusterSpec`` is one kind of accelerator plus how devices are wired: ``devices_per_node``
share the fast intra-node fabric (NVLink, or a TPU pod's ICI torus) and talk to other nodes over
the slower inter-node network. Bandwidths are per device and per direction, in bytes/s: the rate
at which one device can push bytes into a ring collective (what NCCL calls bus bandwidth).

Built-in entries come from the vendors' data sheets (dense bf16 tensor-core peak, no sparsity).
Custom entries are read from a TOML or JSON file with one table per cluster::

    [clusters.my-gpu]
    peak_tflops = 500          # dense bf16
    memory_gb = 96
    hbm_tb_s = 3.0
    devices_per_node = 8
    intra_node_gb_s = 300      # per device, per direction
    inter_node_gb_s = 25
    gemm_efficiency = 0.8      # share of peak of a large GEMM
    gemm_half_dim = 128        # smallest GEMM side at which efficiency halves
    attention_efficiency = 0.4 # share of peak of fused attention (forward + backward)
    collective_efficiency = 0.8   # optional: large-payload bus bandwidth / link bandwidth
    collective_half_mb = 12       # optional: payload at which a collective reaches half of that
    layer_host_us = 0             # optional: host time per layer and microbatch (CPU dispatch);
                                  # also tp_/fsdp_layer_host_us, and optimizer_layer_host_us,
                                  # tp_/fsdp_optimizer_layer_host_us per layer and step

``densetrain plan --calibrate`` measures these on the machine it runs on and writes such a file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from densetrain.errors import UserError

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 reads JSON cluster files only
    tomllib = None

GB = 1e9
"""Decimal gigabyte, the unit of accelerator data sheets and of the ZeRO paper's figures."""


HOST_FIELDS = ("layer_host_s", "tp_layer_host_s", "fsdp_layer_host_s", "optimizer_layer_host_s",
               "tp_optimizer_layer_host_s", "fsdp_optimizer_layer_host_s")
"""Host-time fields of a ``ClusterSpec`` (files give them in microseconds, ``*_us``)."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """One accelerator type and its interconnect, as the planner models it."""

    name: str
    peak_flops: float
    """Dense bf16 peak FLOP/s of one device."""
    memory_bytes: float
    """Device memory in bytes."""
    hbm_bytes_per_s: float
    """Device memory bandwidth (bounds the optimizer step)."""
    devices_per_node: int
    """Devices joined by the intra-node fabric."""
    intra_node_bytes_per_s: float
    """Per-device, per-direction bandwidth inside a node."""
    inter_node_bytes_per_s: float
    """Per-device, per-direction bandwidth between nodes."""
    gemm_efficiency: float = 0.8
    """Share of peak a large, well-shaped bf16 GEMM reaches (measured maximum achievable)."""
    gemm_half_dim: float = 128.0
    """Smallest GEMM dimension at which efficiency is half of ``gemm_efficiency``."""
    attention_efficiency: float = 0.4
    """Share of peak the fused attention kernel reaches (forward + backward)."""
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 15e-6
    collective_efficiency: float = 1.0
    """Bus bandwidth a ring collective reaches with a large payload, as a share of the link
    bandwidth (what nccl-tests reports against the data sheet)."""
    collective_half_bytes: float = 0.0
    """Payload at which a collective reaches half of its large-payload bandwidth: the bandwidth
    of a payload S is ``link x collective_efficiency x S / (S + collective_half_bytes)``
    (0: every payload runs at the large-payload rate)."""
    layer_host_s: float = 0.0
    """Host time per layer and microbatch (forward + backward) beyond the device's work: eager
    dispatch on a CPU, where it adds to the step. 0 on GPUs, whose host runs ahead."""
    tp_layer_host_s: float = 0.0
    """The same with tensor parallelism (DTensor's dispatch); 0: as ``layer_host_s``."""
    fsdp_layer_host_s: float = 0.0
    """The same with FSDP2 (ZeRO-3: its hooks and copies); 0: as ``layer_host_s``."""
    optimizer_layer_host_s: float = 0.0
    """Host time of the optimizer step per layer of the stage (per step, not per microbatch)."""
    tp_optimizer_layer_host_s: float = 0.0
    """The same with tensor-parallel (DTensor) parameters; 0: as ``optimizer_layer_host_s``."""
    fsdp_optimizer_layer_host_s: float = 0.0
    """The same with FSDP2's (DTensor) parameters; 0: as ``optimizer_layer_host_s``."""
    description: str = ""

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "memory_bytes",
            "hbm_bytes_per_s",
            "intra_node_bytes_per_s",
            "inter_node_bytes_per_s",
            "gemm_efficiency",
            "gemm_half_dim",
            "attention_efficiency",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise UserError(f"cluster {self.name!r}: {name} must be > 0, got {value!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise UserError(
                f"cluster {self.name!r}: devices_per_node must be a positive integer, "
                f"got {self.devices_per_node!r}"
            )
        if not isinstance(self.collective_efficiency, (int, float)) or not (
                0 < self.collective_efficiency <= 1):
            raise UserError(f"cluster {self.name!r}: collective_efficiency must be in (0, 1], "
                            f"got {self.collective_efficiency!r}")
        if not isinstance(self.collective_half_bytes, (int, float)) or (
                self.collective_half_bytes < 0):
            raise UserError(f"cluster {self.name!r}: collective_half_bytes must be >= 0, "
                            f"got {self.collective_half_bytes!r}")
        for name in ("gemm_efficiency", "attention_efficiency"):
            if getattr(self, name) > 1:
                raise UserError(f"cluster {self.name!r}: {name} must be <= 1 (a share of peak)")
        for name in ("intra_node_latency_s", "inter_node_latency_s", *HOST_FIELDS):
            if getattr(self, name) < 0:
                raise UserError(f"cluster {self.name!r}: {name} must be >= 0")


def _gpu(name: str, tflops: float, mem_gb: float, hbm_tb_s: float, nvlink: float, net: float,
         description: str, *, gemm: float, attention: float, collective: float) -> ClusterSpec:
    return ClusterSpec(
        gemm_efficiency=gemm,
        attention_efficiency=attention,
        collective_efficiency=collective,
        collective_half_bytes=NCCL_HALF_BYTES,
        name=name,
        peak_flops=tflops * 1e12,
        memory_bytes=mem_gb * GB,
        hbm_bytes_per_s=hbm_tb_s * 1e12,
        devices_per_node=8,
        intra_node_bytes_per_s=nvlink * GB,
        inter_node_bytes_per_s=net * GB,
        description=description,
    )


# NVLink figures are the data sheets' bidirectional totals halved (A100 600 -> 300 GB/s,
# H100/H200 900 -> 450 GB/s); the network is one NIC per GPU (HDR 200 Gb/s = 25 GB/s for
# DGX A100, NDR 400 Gb/s = 50 GB/s for DGX H100/H200).
# GEMM efficiency: the measured maximum achievable bf16 matmul FLOP/s over the data-sheet peak
# (S. Bekman, "Machine Learning Engineering", compute/accelerator, MAMF table: A100 SXM 271.2 of
# 312 = 86.9%, H100 SXM 792.1 of 989 = 80.1%, GH200 (the H200's HBM3e) 828.6 of 989 = 83.6%).
# Attention efficiency: FlashAttention-2 (the kernel behind torch SDPA's flash path) reaches
# 50-73% of peak forward and up to 63% backward on A100 (Dao 2023, sec. 4.1); on H100 it reaches
# 35% (Shah et al. 2024, FlashAttention-3, sec. 1). Forward + backward: 0.6 on A100, 0.35 on
# H100/H200.
# Collectives: the bus bandwidth of NCCL's all-reduce grows with the payload. On an 8x H200 node
# nccl-tests reads 72 GB/s at 1 MiB, 182 at 8 MiB, 298 at 32 MiB, 411 at 128 MiB and 464-481 from
# 1 GiB (S. Bekman, "Machine Learning Engineering", network/benchmarks, the nccl-tests column);
# S / (S + 12 MiB) of the large-payload rate fits that table within 10% from 8 MiB up (the
# range of per-layer activations and gradient buckets) and is taken for every GPU entry. The
# large-payload rate is the data sheet's on H100/H200 (NVLink SHARP reaches it) and 235 of 300
# GB/s on A100 (the same book, network chapter: nccl-tests all-reduce on an A100 node).
NCCL_HALF_BYTES = 12 * 2**20
BUILTIN_CLUSTERS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        _gpu("a100-40gb", 312, 40, 1.555, 300, 25, "NVIDIA A100 SXM 40GB, 8 per node, HDR IB",
             gemm=0.869, attention=0.6, collective=235 / 300),
        _gpu("a100-80gb", 312, 80, 2.039, 300, 25, "NVIDIA A100 SXM 80GB, 8 per node, HDR IB",
             gemm=0.869, attention=0.6, collective=235 / 300),
        _gpu("h100-80gb", 989, 80, 3.35, 450, 50, "NVIDIA H100 SXM 80GB, 8 per node, NDR IB",
             gemm=0.801, attention=0.35, collective=1.0),
        _gpu("h200-141gb", 989, 141, 4.8, 450, 50, "NVIDIA H200 SXM 141GB, 8 per node, NDR IB",
             gemm=0.836, attention=0.35, collective=1.0),
        # TPU v4 (Cloud TPU data sheet: 275 TFLOP/s bf16, 32 GiB HBM at 1.2 TB/s, ICI 2400 Gb/s
        # per chip over 6 links; a ring along one torus axis uses 2 links = 100 GB/s). The "node"
        # is one 4096-chip pod (one ICI domain); pods talk over the data-centre network, which
        # PaLM (Chowdhery et al. 2022, sec. 4) reports as 81 Tb/s per 3072-chip pod, 3.3 GB/s
        # per chip.
        ClusterSpec(
            name="tpu-v4",
            peak_flops=275e12,
            memory_bytes=32 * 2**30,
            hbm_bytes_per_s=1.2e12,
            devices_per_node=4096,
            intra_node_bytes_per_s=100 * GB,
            inter_node_bytes_per_s=3.3 * GB,
            # No published matmul-efficiency measurement: taken as the A100's; an assumption.
            gemm_efficiency=0.869,
            attention_efficiency=0.6,
            description="TPU v4-like: 4096-chip ICI pods joined by the data-centre network",
        ),
    )
}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb", "tpuv4": "tpu-v4"}

_FILE_FIELDS = {
    "peak_tflops": ("peak_flops", 1e12),
    "memory_gb": ("memory_bytes", GB),
    "hbm_tb_s": ("hbm_bytes_per_s", 1e12),
    "devices_per_node": ("devices_per_node", 1),
    "intra_node_gb_s": ("intra_node_bytes_per_s", GB),
    "inter_node_gb_s": ("inter_node_bytes_per_s", GB),
    "gemm_efficiency": ("gemm_efficiency", 1),
    "gemm_half_dim": ("gemm_half_dim", 1),
    "attention_efficiency": ("attention_efficiency", 1),
    "intra_node_latency_us": ("intra_node_latency_s", 1e-6),
    "inter_node_latency_us": ("inter_node_latency_s", 1e-6),
    "collective_efficiency": ("collective_efficiency", 1),
    "collective_half_mb": ("collective_half_bytes", 2**20),
    **{f"{name[:-2]}_us": (name, 1e-6) for name in HOST_FIELDS},
    "description": ("description", None),
}
_REQUIRED = ("peak_tflops", "memory_gb", "hbm_tb_s", "devices_per_node", "intra_node_gb_s",
             "inter_node_gb_s", "gemm_efficiency", "gemm_half_dim", "attention_efficiency")


def load_cluster_file(path: str | Path) -> dict[str, ClusterSpec]:
    """Read custom clusters from a TOML or JSON file (format in the module docstring).

    Raises ``ValueError`` naming the file, the cluster and the field when an entry is malformed.
    """
    path = Path(path)
    text = path.read_text()
    if path.suffix != ".json" and tomllib is None:
        raise UserError(f"{path}: TOML cluster files need Python >= 3.11; use a .json file")
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except ValueError as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise UserError(f"{path}: cannot parse cluster file: {e}") from None
    tables = data.get("clusters")
    if not isinstance(tables, dict) or not tables:
        raise UserError(f"{path}: expected a non-empty [clusters.<name>] table")
    return {name: _cluster_from_table(path, name, table) for name, table in tables.items()}


def _cluster_from_table(path: Path, name: str, table: object) -> ClusterSpec:
    if not isinstance(table, dict):
        raise UserError(f"{path}: clusters.{name} must be a table of fields")
    unknown = sorted(set(table) - set(_FILE_FIELDS))
    if unknown:
        raise UserError(
            f"{path}: clusters.{name} has unknown fields {unknown}; allowed: {sorted(_FILE_FIELDS)}"
        )
    missing = [f for f in _REQUIRED if f not in table]
    if missing:
        raise UserError(f"{path}: clusters.{name} is missing required fields {missing}")
    kwargs: dict[str, object] = {"name": name}
    for key, value in table.items():
        field_name, scale = _FILE_FIELDS[key]
        if scale is None:
            kwargs[field_name] = str(value)
        elif field_name == "devices_per_node":
            kwargs[field_name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            kwargs[field_name] = float(value) * scale
        else:
            raise UserError(f"{path}: clusters.{name}.{key} must be a number, got {value!r}")
    try:
        return ClusterSpec(**kwargs)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def get_cluster(name: str, extra: dict[str, ClusterSpec] | None = None) -> ClusterSpec:
    """Return the cluster called ``name`` from ``extra`` (custom entries) or the built-in table."""
    table = {**BUILTIN_CLUSTERS, **(extra or {})}
    key = name if name in table else _ALIASES.get(name.lower(), name.lower())
    if key not in table:
        raise UserError(f"unknown cluster {name!r}; known: {sorted(table)} (or pass a file)")
    return table[key]


def with_overrides(cluster: ClusterSpec, **changes: object) -> ClusterSpec:
    """A copy of ``cluster`` with fields replaced (validated)."""
    return dataclasses.replace(cluster, **changes)
