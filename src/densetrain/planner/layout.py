"""What the planner varies (``Layout``), what it holds fixed (``PlanSettings``), and a columnar
form of many layouts (``LayoutColumns``) that the vectorised models evaluate at once.

Field names follow ``densetrain.parallel.config.ParallelConfig`` so that a planned layout maps
one to one onto a ``[parallel]`` config section. ``zero_stage=0`` is plain data parallelism
(``dp_shard=1``); stages 1-3 shard over ``dp_shard`` and replicate over ``dp_replicate`` (HSDP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from densetrain.errors import UserError
from densetrain.parallel.config import ACTIVATION_CHECKPOINTING, PP_SCHEDULES
from densetrain.parallel.layout_check import INTERLEAVED_SCHEDULES
from densetrain.values import is_int_at_least

AC_POLICIES = ACTIVATION_CHECKPOINTING
"""The trainer's activation-checkpointing policies (``parallel.checkpointing``)."""
__all__ = ["AC_POLICIES", "PP_SCHEDULES", "PRECISIONS", "Layout", "LayoutColumns", "PlanSettings"]

PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    # name: (param bytes, grad bytes, optimizer-state bytes, bytes per gathered/communicated param)
    # ZeRO paper (Rajbhandari et al. 2020, sec. 3.1): fp16/bf16 params and grads, fp32 master
    # copy + Adam momentum + variance (K = 12).
    "bf16-mixed": (2, 2, 12, 2),
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded params and
    # grads, fp32 Adam moments; parameters are all-gathered in bf16.
    "fsdp2-bf16": (4, 4, 8, 2),
    "fp32": (4, 4, 8, 4),
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to lay a training step over devices."""

    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    cp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 0
    activation_checkpointing: str = "none"
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pp_virtual_stages", "cp", "dp_replicate", "dp_shard",
                     "micro_batch_size"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise UserError(f"layout.{name} must be a positive integer, got {value!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise UserError(f"layout.pp_schedule must be one of {PP_SCHEDULES}, "
                             f"got {self.pp_schedule!r}")
        if self.activation_checkpointing not in AC_POLICIES:
            raise UserError(f"layout.activation_checkpointing must be one of {AC_POLICIES}, "
                             f"got {self.activation_checkpointing!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise UserError(f"layout.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.zero_stage == 0 and self.dp_shard != 1:
            raise UserError("layout.zero_stage=0 (plain data parallel) needs dp_shard=1")
        if self.pp_virtual_stages > 1 and self.pp_schedule not in INTERLEAVED_SCHEDULES:
            raise UserError(f"layout.pp_virtual_stages > 1 needs an interleaved pp_schedule "
                             f"{INTERLEAVED_SCHEDULES}")
        if self.sequence_parallel and self.tp == 1:
            raise UserError("layout.sequence_parallel needs tp > 1")

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def devices(self) -> int:
        """Devices the layout occupies."""
        return self.dp * self.tp * self.pp * self.cp

    def num_microbatches(self, global_batch: int) -> int:
        """Microbatches per step per data-parallel rank; ``ValueError`` if they do not divide."""
        per_step = self.dp * self.micro_batch_size
        if global_batch % per_step:
            raise UserError(
                f"global batch {global_batch} is not a multiple of dp ({self.dp}) x "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return global_batch // per_step

    def describe(self) -> str:
        """Compact one-line form, e.g. ``tp8+sp pp4/1f1b cp1 dp2x64 z3 ac=none mbs1``."""
        tp = f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")
        pp = f"pp{self.pp}"
        if self.pp > 1:
            pp += f"/{self.pp_schedule}"
            if self.pp_virtual_stages > 1:
                pp += f"x{self.pp_virtual_stages}"
        return (f"{tp} {pp} cp{self.cp} dp{self.dp_replicate}x{self.dp_shard} "
                f"z{self.zero_stage} ac={self.activation_checkpointing} "
                f"mbs{self.micro_batch_size}")

    def to_parallel_config(self) -> dict[str, object]:
        """The matching ``[parallel]`` section fields (``ParallelConfig`` names).

        Plain data parallelism (``zero_stage=0``) is ``dp_shard=1`` with ``zero_stage=3``: the
        trainer then replicates (DDP) or, on one data-parallel rank, runs unsharded; stage 3 is
        what it composes with pipelines.
        """
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "zero_stage": self.zero_stage or 3,
            "sequence_parallel": self.sequence_parallel,
            "pp_schedule": self.pp_schedule,
            "pp_virtual_stages": self.pp_virtual_stages,
            "activation_checkpointing": self.activation_checkpointing,
        }


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Assumptions held fixed across the search."""

    precision: str = "bf16-mixed"
    """A key of ``PRECISIONS``."""
    compute_efficiency: float | None = None
    """Share of peak FLOP/s a large GEMM reaches; None takes the cluster's measured figure."""
    tp_overlap: float = 0.0
    """Share of tensor-parallel communication hidden behind compute (0: none, as in eager
    PyTorch; async-TP / Megatron's comm overlap hide part of it)."""
    dp_overlap: bool = True
    """Data-parallel traffic overlaps compute (torch DDP's and FSDP's bucketed reductions and
    prefetched all-gathers). False: it runs after the backward, as in Megatron-LM's 2021-22
    "local" DDP, which all-reduced its contiguous gradient buffer once the pipeline had
    flushed (Narayanan et al. 2021; Korthikanti et al. 2022)."""
    checkpoint_early_stop: bool = True
    """Full recompute as torch's non-reentrant checkpoint runs it (the trainer's): it stops once
    the tensors backward needs are rebuilt, so a pre-norm sequential block without dropout does
    not re-run its last matmul (the MLP's down projection). False: the whole block forward is
    repeated (Megatron-LM's and Korthikanti et al. 2022's count)."""
    flash_attention: bool = True
    """Attention that never stores the s x s scores (FlashAttention / SDPA)."""
    attention_dropout: bool = False
    """Dropout on attention probabilities and residual branches (masks cost 1 byte/element)."""
    selective_keeps_matmul_outputs: bool = True
    """The ``selective`` policy as the trainer runs it (`parallel.checkpointing`): the matmul
    and attention outputs kept but the row-parallel ones, the reduced attention output kept,
    norms and the MLP activation recomputed (`planner.memory.selective_matmul_bytes`). False:
    Korthikanti et al. 2022's selective recompute (only the attention core recomputed), as
    Megatron-LM runs it. Traced per layer (tests/unit/dryrun/test_layer_memory.py)."""
    pp_scatter_gather: bool = False
    """Megatron-LM's scatter/gather optimisation (Narayanan et al. 2021 §4.1): each tp rank
    sends 1/tp of the stage boundary's activation. False: torch's pipeline stages (the
    trainer's) send the whole activation from every tp rank, tp times the bytes; traced by the
    dry run of Llama 3 70B (docs/planner.md)."""
    pp_recv_buffer_per_microbatch: bool = False
    """torch's own pipeline stage: at its first step each stage allocates one activation and one
    gradient receive buffer per microbatch of the step, kept for the schedule's life; the
    fullest rank (pp rank 0: its first stage gets no activations, so ``2v - 1`` buffers per
    microbatch) holds ``m (2v - 1) b s h`` elements of the residual stream's dtype. False: a
    buffer per transfer (the trainer's stages, `parallel.pipeline`, and Megatron-LM): the
    in-flight chunks' received inputs and the gradient being received. Found by the dry run of
    Llama 3 405B (docs/planner.md)."""
    pp_holds_stage_outputs: bool = False
    """True: torch's own pipeline stage, whose schedule keeps each in-flight microbatch's stage
    output (whole-sequence under sequence parallel, which gathers it to send it) until its
    backward: ``b s h`` elements of the residual stream's dtype per chunk in flight. False: the
    output's data freed once sent (the trainer's stages, `parallel.pipeline`, and
    Megatron-LM): only the send in flight holds one. Found by the dry run of Llama 3 405B
    (docs/planner.md)."""
    single_rank_fsdp: bool = False
    """A layout without sharded data parallelism (dp_shard x cp = 1) computes in bf16 copies of
    fp32 parameters made by FSDP2 over a one-rank shard group (the trainer's
    ``parallel.param_dtype = "compute"`` on tensor, pipeline or plain data parallel,
    `parallel.parallelize.single_rank_fsdp`): the residual stream is in the gathered dtype and
    FSDP's per-layer buffers (and a pipeline stage's gathered parameters) are held as under
    ZeRO-3, with no data-parallel traffic beyond plain data parallel's fp32 all-reduce. False:
    such a layout computes with its parameters' own dtype (autocast over fp32, or the
    ``bf16-mixed`` precision's bf16 parameters)."""
    pp_keeps_stage_unsharded: bool = True
    """ZeRO-3 under pipeline parallel as torch's schedule runs it: the backward of every
    microbatch but the last keeps the stage's parameters gathered (no reshard after backward,
    no gradient reduce-scatter until the last), so a rank holds its stage's whole parameters,
    unsharded over data parallel, through the step. Found by the dry run of Llama 3 70B
    (docs/planner.md)."""
    pp_accumulates_unsharded_grads: bool = True
    """With ``pp_keeps_stage_unsharded``: the stage's gradients too accumulate unsharded (FSDP2
    keeps them in fp32 from the first microbatch's backward until the last reduce-scatters
    them), the stage's whole parameter count in gradient bytes. Found by the dry run of the
    Llama 3 405B last stage (docs/planner.md). False: gradients reduce-scattered every
    microbatch (Llama 3's pipelined FSDP, Dubey et al. 2024 §3.3.2)."""
    pp_reshards_after_forward: bool = True
    """With ``pp_keeps_stage_unsharded``: the trainer's FSDP reshards every unit but the stage's
    last block after each forward and the backward gathers it again (so a unit gathers m + 1
    times a step, `comm.fsdp_calls_per_step`); at a stage's activation peak, the end of a
    forward, only the last block of each of the rank's stages and the one prefetched for the
    backward are gathered, not the whole stage; at the end of a backward the whole stage is
    gathered, less one chunk's activations: the peak is the larger of the two moments. Found by
    the dry run of Llama 3 70B on TP 8 x PP 4 (the last stage: 1.13x the traced peak while the
    whole stage was counted gathered) and of the Llama 3 405B last stage (its peak in backward
    once a layer keeps 340 MiB). False: the stage stays gathered through the step (Llama 3's
    pipelined FSDP, which does not reshard after forward)."""
    chunked_loss: bool = True
    """Output projection + cross-entropy in chunks, so full logits are never held."""
    activation_bytes: int = 2
    usable_memory_fraction: float = 0.92
    """Share of device memory the allocator can hand out (fragmentation, reserved pools)."""
    workspace_gb: float = 1.5
    """Framework context, communication and matmul workspaces."""
    optimizer_step_temporaries: float = 0.0
    """fp32 copies of the rank's parameters the optimizer step allocates at once: 0 for a fused
    kernel (torch's fused AdamW, which the trainer picks on CUDA; Megatron-LM's Apex Adam); 1
    for torch's foreach AdamW (the trainer's on CPU DTensors), whose update is built from
    whole-list temporaries, one the size of the parameters at its peak (traced by the dry run
    of GPT-3 175B, docs/planner.md)."""
    optimizer_bytes_touched: int = 28
    """HBM bytes read+written per locally-updated parameter by the AdamW step."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(f"precision must be one of {sorted(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.compute_efficiency is not None and not 0 < self.compute_efficiency <= 1:
            raise UserError(f"compute_efficiency must be in (0, 1], got {self.compute_efficiency}")
        if not 0 <= self.tp_overlap <= 1:
            raise UserError(f"tp_overlap must be in [0, 1], got {self.tp_overlap}")
        if not 0 < self.usable_memory_fraction <= 1:
            raise UserError("usable_memory_fraction must be in (0, 1], "
                             f"got {self.usable_memory_fraction}")
        if self.workspace_gb < 0:
            raise UserError(f"workspace_gb must be >= 0, got {self.workspace_gb}")

    @property
    def bytes_per_param(self) -> tuple[int, int, int, int]:
        """(param, grad, optimizer, communicated-param) bytes per parameter."""
        return PRECISIONS[self.precision]


_INT_FIELDS = ("tp", "pp", "pp_virtual_stages", "cp", "dp_replicate", "dp_shard", "zero_stage",
               "micro_batch_size")


@dataclass(kw_only=True)
class LayoutColumns:
    """Many layouts as parallel numpy arrays (schedule and policy as indices into the tuples)."""

    tp: np.ndarray
    sequence_parallel: np.ndarray
    pp: np.ndarray
    pp_schedule: np.ndarray
    pp_virtual_stages: np.ndarray
    cp: np.ndarray
    dp_replicate: np.ndarray
    dp_shard: np.ndarray
    zero_stage: np.ndarray
    activation_checkpointing: np.ndarray
    micro_batch_size: np.ndarray

    @classmethod
    def from_layouts(cls, layouts: list[Layout]) -> LayoutColumns:
        """Columns of the given layouts, in order."""
        cols: dict[str, np.ndarray] = {
            name: np.array([getattr(lay, name) for lay in layouts], dtype=np.int64)
            for name in _INT_FIELDS
        }
        cols["sequence_parallel"] = np.array([lay.sequence_parallel for lay in layouts], bool)
        cols["pp_schedule"] = np.array([PP_SCHEDULES.index(lay.pp_schedule) for lay in layouts])
        cols["activation_checkpointing"] = np.array(
            [AC_POLICIES.index(lay.activation_checkpointing) for lay in layouts]
        )
        return cls(**cols)

    def __len__(self) -> int:
        return len(self.tp)

    @property
    def dp(self) -> np.ndarray:
        """Data-parallel degree per row."""
        return self.dp_replicate * self.dp_shard

    def take(self, index: np.ndarray) -> LayoutColumns:
        """The rows selected by a boolean mask or index array."""
        return LayoutColumns(**{f.name: getattr(self, f.name)[index]
                                for f in dataclasses.fields(self)})

    def row(self, i: int) -> Layout:
        """Row ``i`` as a ``Layout``."""
        values = {name: int(getattr(self, name)[i]) for name in _INT_FIELDS}
        return Layout(
            **values,
            sequence_parallel=bool(self.sequence_parallel[i]),
            pp_schedule=PP_SCHEDULES[int(self.pp_schedule[i])],
            activation_checkpointing=AC_POLICIES[int(self.activation_checkpointing[i])],
        )
