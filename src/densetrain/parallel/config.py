"""`ParallelConfig`: the `[parallel]` section of a job — how one model is laid out over ranks.

The degrees name the axes of one device mesh (outermost first):
``pp × dp_replicate × dp_shard × cp × tp``. ``dp_shard = -1`` takes whatever the other degrees
leave of the world size. Validation against the world size and the model lives in
``parallel/layout_check.py`` (``check_layout``, the one set of layout rules); ``validate()`` here
checks only what the config alone can tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from densetrain.errors import UserError
from densetrain.values import is_int_at_least

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
"""Pipeline schedules: GPipe (all forwards then all backwards), 1F1B (PipeDream-Flush),
interleaved 1F1B (Megatron virtual stages), interleaved zero-bubble (Qi et al. 2023, split
backward into input and weight gradients) and its V-shaped variant (two stages per rank)."""
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
ZERO_STAGES = (1, 2, 3)
FLOAT8_RECIPES = ("tensorwise", "rowwise")
"""float8 scaling recipes of ``training.float8_recipe`` (`parallel.float8` says what each does)."""


PP_GRAD_REDUCE = ("step", "microbatch")
"""When a pipelined FSDP stage reduce-scatters its gradients (``parallel.pp_grad_reduce``)."""
RECOMPUTE_PARTS = ("norms", "attention", "mlp_activation")
"""Parts of a block that ``parallel.ac_recompute`` may name (`parallel.checkpointing`)."""
DEFAULT_SELECTIVE_PARTS = ("norms", "mlp_activation")
"""What "selective" recomputes when ``parallel.ac_recompute`` is empty."""


def check_recompute_parts(parts) -> None:
    """Raise ``UserError`` naming ``parallel.ac_recompute`` when a part is not known."""
    for part in parts:
        if part not in RECOMPUTE_PARTS:
            raise UserError(f"parallel.ac_recompute: {part!r} is not a part of a block; "
                            f"allowed: {list(RECOMPUTE_PARTS)}")


PARAM_DTYPES = ("compute", "fp32")
"""Allowed ``parallel.param_dtype`` values."""


def computes_in_bf16_params(parallel: ParallelConfig, training_dtype: str) -> bool:
    """Whether a job's layers compute in bf16 copies of fp32 parameters: ``training.dtype`` bf16
    with ``parallel.param_dtype`` "compute" (FSDP's bf16 gathers, or FSDP over one-rank shards
    where data parallelism is not sharded: `parallel.parallelize.single_rank_fsdp`)."""
    return training_dtype == "bf16" and parallel.param_dtype == "compute"


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of each kind of parallelism and their options.

    Every degree is a positive integer except ``dp_shard``, which may be -1 (fill the rest of the
    world). The product ``pp * dp_replicate * dp_shard * cp * tp`` must equal the world size.
    """

    dp_replicate: int = 1
    """Replicated data-parallel degree (DDP; the outer axis of HSDP)."""
    dp_shard: int = -1
    """Sharded data-parallel degree (ZeRO/FSDP); -1 means the world size over the other degrees."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row splits)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context-parallel degree (sequence sharded, exact causal attention)."""
    zero_stage: int = 3
    """1: optimizer states sharded; 2: and gradients; 3: and parameters (FSDP), over dp_shard."""
    sequence_parallel: bool = True
    """With tp > 1, shard the norm/dropout regions over the sequence (Korthikanti et al. 2022)."""
    pp_schedule: str = "1f1b"
    """One of ``PP_SCHEDULES``."""
    pp_microbatches: int = 0
    """Microbatches per step for the pipeline. 0: the trainer uses the rank's batch over
    ``training.micro_batch_size`` (`parallel.build.pipeline_microbatches`; with the derived
    micro-batch size that is pp); `parallel.pipeline.build_pipeline` called directly uses pp."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank; > 1 only with interleaved schedules (zbv needs exactly 2)."""
    pp_grad_reduce: str = "step"
    """With FSDP under a pipeline: "step" accumulates each stage's gradients unsharded (fp32)
    over the step's microbatches and reduce-scatters them once, after the last; "microbatch"
    reduce-scatters them after every microbatch's backward into the sharded gradient (Llama 3's
    pipelined FSDP, Dubey et al. 2024 §3.3.2: the stage's whole fp32 gradients never held, m
    times the reduce-scatter traffic). Not with the zero-bubble schedules, which split a
    backward in two."""
    pp_reshard_after_forward: bool = True
    """With FSDP under a pipeline: whether each block's gathered parameters are freed after its
    forward (gathered again by its backward, once per microbatch) or kept until the step's last
    backward (Llama 3's pipelined FSDP, Dubey et al. 2024 §3.3.2: "we do not reshard after
    forward computation", one all-gather per step for the stage's whole bf16 parameters held
    over the step). Needs pp > 1."""
    pp_layer_split: list[int] = field(default_factory=list)
    """Layers per stage (sums to num_layers); empty means as balanced as possible."""
    activation_checkpointing: str = "none"
    """"none" (keep what backward reads; under sequence parallelism the sequence shards, the
    gathers made again in backward), "selective" (recompute the parts ``ac_recompute`` names)
    or "full" (recompute each checkpointed block from its input). docs/parallelism.md lists
    what each keeps, tensor by tensor."""
    ac_recompute: list[str] = field(default_factory=list)
    """With "selective": the parts of a block recomputed in backward, any of "norms",
    "attention" (the attention core), "mlp_activation"; empty means ["norms",
    "mlp_activation"]."""
    ac_every: int = 1
    """Apply the mode to every k-th block (1 = all blocks); the others run as "none"."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2 offload)."""
    param_dtype: str = "compute"
    """Dtype the layers' parameters are computed in: "compute" (the training dtype: bf16 under
    ``training.dtype = "bf16"``) or "fp32" (fp32 parameters, cast by autocast for each matmul,
    as one process does). With "compute" the residual stream, the tensor- and
    sequence-parallel collectives, the FSDP all-gathers and the pipeline sends are bf16, while
    the parameters the optimizer steps (its master weights), the gradients and their
    reduction stay fp32. FSDP gathers its shards in bf16; a layout without sharded data
    parallelism (tensor or pipeline parallel alone, plain data parallel) runs FSDP2 over a
    one-rank shard group (`parallelize.single_rank_fsdp`): its fp32 shard is the whole
    parameter, the bf16 copy is made as FSDP would gather it, and gradients accumulate in fp32
    (Megatron-LM's bf16 with fp32 main parameters and gradients). ZeRO-1/2 and one process
    keep fp32 parameters under autocast."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this fails with an error naming the rank and step."""

    def __post_init__(self) -> None:
        # A section is checked when it is built (a bad ParallelConfig cannot be made); the job's
        # validation checks the section a job carries once more, as fields may be set later.
        # Nothing else re-checks it (`ParallelDims.from_config` relies on these two).
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the allowed values when a value is invalid."""
        for name in ("dp_replicate", "tp", "pp", "cp", "pp_virtual_stages", "ac_every"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise UserError(f"parallel.{name} must be a positive integer, got {value!r}")
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or (
            self.dp_shard < 1 and self.dp_shard != -1
        ):
            raise UserError(
                f"parallel.dp_shard must be a positive integer or -1 (the rest of the world), "
                f"got {self.dp_shard!r}"
            )
        if self.zero_stage not in ZERO_STAGES:
            raise UserError(
                f"parallel.zero_stage must be one of {list(ZERO_STAGES)}, got {self.zero_stage!r}"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise UserError(
                f"parallel.pp_schedule must be one of {list(PP_SCHEDULES)}, "
                f"got {self.pp_schedule!r}"
            )
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise UserError(
                "parallel.activation_checkpointing must be one of "
                f"{list(ACTIVATION_CHECKPOINTING)}, got {self.activation_checkpointing!r}"
            )
        if self.pp_grad_reduce not in PP_GRAD_REDUCE:
            raise UserError(f"parallel.pp_grad_reduce must be one of {list(PP_GRAD_REDUCE)}, "
                            f"got {self.pp_grad_reduce!r}")
        if self.pp_grad_reduce == "microbatch" and self.pp_schedule in ("zero_bubble", "zbv"):
            raise UserError(
                f'parallel.pp_grad_reduce="microbatch" runs with the gpipe, 1f1b and '
                f'interleaved_1f1b schedules, not pp_schedule="{self.pp_schedule}" (it splits '
                'each backward into input and weight gradients); use pp_grad_reduce="step"')
        if not self.pp_reshard_after_forward and self.pp == 1:
            raise UserError("parallel.pp_reshard_after_forward=false keeps a pipeline stage's "
                            "parameters gathered between microbatches and needs pp > 1 (got "
                            "pp=1); without a pipeline each block is gathered once per "
                            "microbatch anyway")
        if not isinstance(self.ac_recompute, list):
            raise UserError("parallel.ac_recompute must be a list of block parts, e.g. "
                            f'["norms", "mlp_activation"], got {self.ac_recompute!r}')
        check_recompute_parts(self.ac_recompute)
        if self.param_dtype not in PARAM_DTYPES:
            raise UserError(
                f"parallel.param_dtype must be one of {list(PARAM_DTYPES)}, "
                f"got {self.param_dtype!r}"
            )
        if not isinstance(self.pp_microbatches, int) or self.pp_microbatches < 0:
            raise UserError(
                f"parallel.pp_microbatches must be >= 0 (0 = pp), got {self.pp_microbatches!r}"
            )
        from densetrain.parallel.layout_check import config_reasons

        problems = config_reasons(self)
        if problems:
            raise UserError(problems[0])
        if not isinstance(self.pp_layer_split, list) or any(
            not is_int_at_least(n, 1) for n in self.pp_layer_split
        ):
            raise UserError(
                "parallel.pp_layer_split must be a list of positive layer counts per stage, "
                f"got {self.pp_layer_split!r}"
            )
        if self.collective_timeout_s <= 0:
            raise UserError(
                f"parallel.collective_timeout_s must be > 0, got {self.collective_timeout_s!r}"
            )
