"""IsoFLOP sweeps: design (budgets × model sizes, D = C / (6·N)), run, and collect results.

Each point is a ``densetrain train`` run with ``--section.field=value`` overrides. Runs go one
after another on this machine, or are emitted as torchrun command lines or SLURM batch scripts.
A point whose run directory already holds ``summary.json`` is not run again, so an interrupted
sweep resumes where it stopped.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass, field

import numpy as np

from densetrain.errors import UserError
from densetrain.scaling.shapes import PARAM_COUNTS, ModelShape, nearest_shape

LAUNCHERS = ("local", "torchrun", "slurm")


@dataclass(kw_only=True)
class SweepConfig:
    """An IsoFLOP design and the training settings shared by its runs.

    Attributes:
        budgets: FLOP budgets C (C = 6·N·D with N counted as ``param_count``).
        sizes_per_budget: model sizes per budget, log-spaced over ``n_span``.
        n_span: ratio of the largest to the smallest target N of a budget.
        tokens_per_param: centre of each budget's N range: N = sqrt(C / (6 · tokens_per_param)).
            Chinchilla's compute-optimal ratio is about 20 at 1e18-1e24 FLOPs; the CPU sweeps
            of docs/scaling.md put it near 10 (total N) at 1e11-1e13, hence the default.
        param_count: "total" (Chinchilla, the default) or "non_embedding" (Kaplan) parameters
            as N. With total N, C = 6·N·D is close to the compute the runs really spend, so a
            budget's wall time is predictable; see shapes.py for the trade-off.
        seq_len, global_batch_size, micro_batch_size: batch geometry (sequences of seq_len).
        lr, warmup_fraction: peak learning rate and the share of steps used to warm up; the
            trainer's cosine schedule spans each run (Chinchilla §3: cycle length = run length).
        min_steps: a point needing fewer optimizer steps is dropped from the design.
        vocab_size: tokenizer size of the default corpus (``data.default_vocab_size``).
        aspect_ratio: preferred dim / num_layers among shapes of about the same N.
        preset: base model preset whose size fields the design overrides.
        seed: training and data seed of every run.
        extra_overrides: further ``--section.field=value`` strings passed to every run.
    """

    budgets: list[float]
    sizes_per_budget: int = 6
    n_span: float = 16.0
    tokens_per_param: float = 10.0
    param_count: str = "total"
    seq_len: int = 128
    global_batch_size: int = 16
    micro_batch_size: int = 16
    lr: float = 3e-3
    warmup_fraction: float = 0.05
    min_steps: int = 20
    vocab_size: int = 1024
    aspect_ratio: float = 32.0
    preset: str = "tiny-llama"
    seed: int = 0
    extra_overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a setting is out of range."""
        if not self.budgets:
            raise UserError("budgets must list at least one FLOP budget")
        for i, budget in enumerate(self.budgets):
            if not (math.isfinite(budget) and budget > 0):
                raise UserError(f"budgets[{i}] must be a finite number > 0, got {budget}")
        if self.sizes_per_budget < 3:
            raise UserError(
                f"sizes_per_budget must be >= 3 (a parabola needs 3 points), got "
                f"{self.sizes_per_budget}"
            )
        if not self.n_span > 1:
            raise UserError(f"n_span must be > 1, got {self.n_span}")
        if not self.tokens_per_param > 0:
            raise UserError(f"tokens_per_param must be > 0, got {self.tokens_per_param}")
        if self.param_count not in PARAM_COUNTS:
            raise UserError(f"param_count must be one of {PARAM_COUNTS}, got {self.param_count!r}")
        for name in ("seq_len", "global_batch_size", "micro_batch_size", "min_steps"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise UserError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if not self.lr > 0:
            raise UserError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise UserError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step."""
        return self.global_batch_size * self.seq_len


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One run of the design: a budget, a shape, and the tokens that spend the budget."""

    name: str
    budget: float
    target_params: float
    shape: ModelShape
    params: int
    steps: int
    tokens: int
    warmup_steps: int

    @property
    def flops(self) -> float:
        """6·N·D actually scheduled (D rounded to whole steps)."""
        return 6.0 * self.params * self.tokens


def design_sweep(cfg: SweepConfig) -> list[SweepPoint]:
    """IsoFLOP design: for each budget, ``sizes_per_budget`` shapes log-spaced around
    N = sqrt(C / (6·tokens_per_param)) and steps such that 6·N·D ≈ C.

    Targets mapping to an already chosen shape, or needing fewer than ``min_steps`` steps, are
    dropped; a budget left with fewer than 3 sizes raises ``ValueError``.
    """
    cfg.validate()
    points: list[SweepPoint] = []
    for budget in sorted(cfg.budgets):
        centre = math.sqrt(budget / (6.0 * cfg.tokens_per_param))
        offsets = np.linspace(-0.5, 0.5, cfg.sizes_per_budget) * math.log(cfg.n_span)
        chosen: list[SweepPoint] = []
        for target in centre * np.exp(offsets):
            shape, params = nearest_shape(
                float(target), vocab_size=cfg.vocab_size, max_seq_len=cfg.seq_len,
                param_count=cfg.param_count, aspect_ratio=cfg.aspect_ratio,
            )
            steps = int(round(budget / (6.0 * params) / cfg.tokens_per_step))
            if steps < cfg.min_steps or any(p.shape == shape for p in chosen):
                continue
            name = f"C{budget:.2g}_d{shape.dim}_l{shape.num_layers}".replace("+", "")
            chosen.append(SweepPoint(
                name=name, budget=float(budget), target_params=float(target), shape=shape,
                params=params, steps=steps, tokens=steps * cfg.tokens_per_step,
                warmup_steps=max(1, int(round(cfg.warmup_fraction * steps))),
            ))
        if len(chosen) < 3:
            raise UserError(
                f"budget {budget:.3g} yields only {len(chosen)} distinct runs with >= "
                f"{cfg.min_steps} steps; raise the budget, lower min_steps or global_batch_size"
            )
        points.extend(chosen)
    return points


def train_overrides(point: SweepPoint, cfg: SweepConfig, run_dir: str) -> list[str]:
    """The ``--section.field=value`` overrides of ``densetrain train`` for ``point``."""
    shape = {f"--model.{k}={v}" for k, v in point.shape.overrides().items()}
    return [
        f"--model.preset={cfg.preset}", *sorted(shape), f"--model.max_seq_len={cfg.seq_len}",
        f"--data.seq_len={cfg.seq_len}", f"--data.seed={cfg.seed}",
        f"--data.default_vocab_size={cfg.vocab_size}",
        f"--training.steps={point.steps}", f"--training.global_batch_size={cfg.global_batch_size}",
        f"--training.micro_batch_size={cfg.micro_batch_size}", f"--training.seed={cfg.seed}",
        f"--schedule.warmup_steps={point.warmup_steps}", f"--optim.lr={cfg.lr}",
        "--checkpoint.enabled=false", f"--logging.run_dir={run_dir}",
        "--logging.progress=false", "--logging.plot=false", "--logging.tensorboard=false",
        f"--eval.interval={point.steps}", "--eval.sample_tokens=0",
        *cfg.extra_overrides,
    ]


def launch_command(
    point: SweepPoint, cfg: SweepConfig, run_dir: str, *, launcher: str = "local",
    nproc_per_node: int = 1, nnodes: int = 1,
) -> list[str]:
    """The command running ``point``: ``python -m densetrain train ...`` or torchrun's.

    For "slurm" this is the ``srun torchrun`` line inside the batch script (see
    ``slurm_script``).
    """
    overrides = train_overrides(point, cfg, run_dir)
    if launcher == "local":
        return [sys.executable, "-m", "densetrain", "train", *overrides]
    if launcher == "torchrun":
        return ["torchrun", "--standalone", f"--nproc-per-node={nproc_per_node}", "-m",
                "densetrain", "train", *overrides]
    if launcher == "slurm":
        return ["srun", "torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:29500"',
                "--rdzv-id=$SLURM_JOB_ID", "-m", "densetrain", "train", *overrides]
    raise UserError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def slurm_script(point: SweepPoint, cfg: SweepConfig, run_dir: str, *, nproc_per_node: int,
                 nnodes: int, time_limit: str = "04:00:00") -> str:
    """An ``sbatch`` script for ``point`` (one torchrun per node via srun)."""
    command = launch_command(point, cfg, run_dir, launcher="slurm",
                             nproc_per_node=nproc_per_node, nnodes=nnodes)
    quoted = " ".join(c if "$" in c else shlex.quote(c) for c in command)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={point.name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc_per_node}",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        quoted,
        "",
    ])
