"""Job config sections owned by the config package: training, checkpoint, eval and logging.

The other sections live beside their code: ``DataConfig`` (data/config.py), ``ParallelConfig``
(parallel/config.py), ``OptimConfig`` and ``ScheduleConfig`` (optim/config.py); the model section
is derived from ``ModelConfig`` in job.py. Every section has ``validate()`` raising ``ValueError``
naming ``section.field``, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass

from densetrain.errors import UserError
from densetrain.parallel.config import FLOAT8_RECIPES

DTYPES = ("fp32", "bf16", "float8")
HOST_ALLOCATORS = ("tuned", "system")  # see densetrain.train.host_malloc
NAN_POLICIES = ("stop", "skip")
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


@dataclass(kw_only=True)
class TrainingConfig:
    """Length, batch and numerics of the run.

    Attributes:
        steps: optimizer steps in the run (the schedule's cycle length).
        global_batch_size: sequences per optimizer step over all data-parallel ranks.
        global_batch_tokens: when > 0, sets ``global_batch_size = global_batch_tokens /
            data.seq_len`` (must divide); GPT-3 and LLaMA state batches in tokens.
        micro_batch_size: sequences per rank per forward/backward; gradient accumulation steps =
            global_batch_size / (micro_batch_size × data-parallel size). 0 (the default) derives
            it once the data-parallel size is known: the rank's whole batch (no accumulation),
            or under pipeline parallelism the rank's batch over the pipeline microbatches
            (``parallel.pp_microbatches``, else ``pp``), so one batch size runs on any layout.
        seed: seed of weight initialisation and of every other random choice of the trainer.
        dtype: ``fp32``, ``bf16`` (bf16 compute with fp32 master weights, gradients and
            optimizer state; ``parallel.param_dtype`` says whether the layers see bf16 copies
            of the weights or cast fp32 ones under autocast),
            or ``float8``: the blocks' linear layers in float8 through torchao (the rest as
            ``bf16``; needs ``densetrain[float8]``; faster only on GPUs with float8 tensor cores).
        float8_recipe: float8 scaling, ``tensorwise`` (one scale per tensor) or ``rowwise``.
        device: ``auto`` (first GPU, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
        compile: apply ``torch.compile`` to each block and to the chunked loss kernel.
        loss_chunk_size: positions per chunk of the output projection + cross-entropy; 0 = the
            full logits at once.
        nan_policy: on a non-finite loss ``stop`` the run naming the step, or ``skip`` the step.
        init_from: initial weights (a densetrain or Hugging Face checkpoint directory); empty =
            random initialisation.
        host_allocator: ``tuned`` (default) keeps a CPU run's large per-step tensors in the
            malloc heap instead of mapping and unmapping them every step (glibc ``mallopt``;
            +14-25% tokens/s on CPU), or ``system`` for the libc defaults.
    """

    steps: int = 300
    global_batch_size: int = 16
    global_batch_tokens: int = 0
    micro_batch_size: int = 0
    seed: int = 0
    dtype: str = "fp32"
    float8_recipe: str = "tensorwise"
    device: str = "auto"
    compile: bool = False
    loss_chunk_size: int = 0
    nan_policy: str = "stop"
    init_from: str = ""
    host_allocator: str = "tuned"

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``training.<field>`` when a value is out of range."""
        for name in ("steps", "global_batch_size"):
            _int_at_least(f"training.{name}", getattr(self, name), 1)
        for name in ("micro_batch_size", "global_batch_tokens", "loss_chunk_size", "seed"):
            _int_at_least(f"training.{name}", getattr(self, name), 0)
        _choice("training.dtype", self.dtype, DTYPES)
        _choice("training.float8_recipe", self.float8_recipe, FLOAT8_RECIPES)
        _choice("training.nan_policy", self.nan_policy, NAN_POLICIES)
        _choice("training.host_allocator", self.host_allocator, HOST_ALLOCATORS)
        if not _DEVICE_PATTERN.match(self.device):
            raise UserError(
                f"training.device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', "
                f"got {self.device!r}"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    """When and where checkpoints are written.

    Attributes:
        enabled: write checkpoints at all.
        dir: checkpoint directory; empty = ``<logging.run_dir>/checkpoints``. May be an fsspec
            URL: ``s3://bucket/prefix`` (needs ``pip install 'densetrain[s3]'``; credentials and
            endpoint from the standard AWS variables, docs/reliability.md) or ``file:///path``.
            On a URL saves are synchronous and a ``step-N`` prefix counts only once its
            manifest, written last, exists and verifies.
        interval: save every this many steps, or ``"auto"``: the interval of Young (1974) and
            Daly (2006), τ = √(2 · δ · M) seconds of training between saves, δ the save stall
            the run measures and M its mean time between failures, estimated from
            ``run_history.jsonl`` (checkpoint/interval.py, docs/reliability.md).
        auto_initial_interval: with ``interval="auto"``, the interval until a save's stall has
            been measured (each process measures its own).
        auto_min_interval: with ``interval="auto"``, never save more often than this.
        mtbf_prior_device_hours: with ``interval="auto"``, the prior MTBF of one device in
            hours, divided by the number of ranks for the job's prior; the default is Llama 3's
            466 interruptions in 54 days on 16,384 GPUs (≈ 45,566 hours).
        keep_last: keep this many most recent checkpoints; 0 keeps all.
        resume: resume from the newest checkpoint in ``dir`` whose manifest verifies (a damaged
            newer one is reported and renamed ``step-N.damaged``).
        save_final: save after the last step whatever the interval.
        async_save: write checkpoints in the background (``torch.distributed.checkpoint``
            async save: the state is staged to CPU memory, then written while training goes
            on; at most one save in flight, visible only once complete).
        allow_config_change: resume even though the config changes the model or the data
            order of the checkpoint (refused otherwise, naming each field); the change is
            logged in ``<run_dir>/run_history.jsonl``.
        preemption_grace_s: after SIGTERM/SIGINT the run saves a checkpoint and exits; past
            this many seconds it exits anyway (set it below the scheduler's kill delay).
        on_save_error: a save that fails (a full disk, an unwritable directory) ``stop``s the
            run with one message naming the step and the directory, or ``continue``s it with
            a warning, the next save being tried as usual. Either way the failed save leaves no
            ``step-N`` directory and the earlier checkpoints are untouched.
    """

    enabled: bool = True
    dir: str = ""
    interval: int | str = 100
    auto_initial_interval: int = 100
    auto_min_interval: int = 10
    mtbf_prior_device_hours: float = 45_566.0  # interval.LLAMA3_DEVICE_MTBF_HOURS, rounded
    keep_last: int = 3
    resume: bool = True
    save_final: bool = True
    async_save: bool = True
    allow_config_change: bool = False
    preemption_grace_s: float = 90.0
    on_save_error: str = "stop"

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``checkpoint.<field>`` when a value is out of range."""
        interval = self.interval
        if interval != "auto" and not (isinstance(interval, int)
                                       and not isinstance(interval, bool) and interval >= 1):
            raise UserError(f"checkpoint.interval must be 'auto' or an integer >= 1, got "
                            f"{interval!r}")
        _int_at_least("checkpoint.auto_initial_interval", self.auto_initial_interval, 1)
        _int_at_least("checkpoint.auto_min_interval", self.auto_min_interval, 1)
        prior = self.mtbf_prior_device_hours
        if not (isinstance(prior, (int, float)) and not isinstance(prior, bool)
                and math.isfinite(prior) and prior > 0):
            raise UserError("checkpoint.mtbf_prior_device_hours must be a finite number of "
                            f"hours > 0, got {prior!r}")
        _int_at_least("checkpoint.keep_last", self.keep_last, 0)
        _choice("checkpoint.on_save_error", self.on_save_error, SAVE_ERROR_ACTIONS)
        from densetrain.storage_url import url_problem

        problem = url_problem("checkpoint.dir", self.dir)
        if problem is not None:
            raise UserError(problem)
        if not (isinstance(self.preemption_grace_s, (int, float))
                and math.isfinite(self.preemption_grace_s) and self.preemption_grace_s > 0):
            raise UserError(
                "checkpoint.preemption_grace_s must be a number of seconds > 0, got "
                f"{self.preemption_grace_s!r}"
            )


# Sampling defaults of the end-of-run sample and of `densetrain generate`: llama.cpp's defaults
# (temperature 0.8, top-k 40, top-p 0.95), which combine top-k 40 of the GPT-2 samples (Radford
# et al. 2019) with the nucleus p = 0.95 of Holtzman et al. 2020 ("The Curious Case of Neural
# Text Degeneration", whose main setting it is), at a temperature below 1 as in nanoGPT's
# sample.py (0.8). Each cuts the unreliable tail that a small model spreads mass over, while
# keeping enough randomness that the text does not fall into greedy decoding's loops.
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 40
SAMPLE_TOP_P = 0.95


@dataclass(kw_only=True)
class EvalConfig:
    """Validation loss cadence and the sample printed with it.

    Attributes:
        interval: evaluate every this many steps; 0 turns evaluation off.
        num_windows: validation windows (``data.seq_len + 1`` tokens each) per evaluation, at
            fixed, evenly spaced positions of the validation split's packed sequences: the same
            tokens whatever ``data.seed``, the batch size or the number of ranks, so validation
            losses of such runs compare (each logs the set's identity as ``val_set``). 0 = the
            whole split; more than the split holds = the whole split.
        num_batches: no longer read (validation takes ``num_windows``, a count independent of
            the batch size); kept so that older configs load.
        sample_prompt: prompt of the sample generated after the last step (and every
            ``logging.sample_interval`` steps); empty = the first ``sample_prompt_tokens``
            tokens of the validation split (real text of the corpus: the continuation shows
            whether the model learnt its structure; a fixed short prompt such as ``def `` says
            little and the same for every corpus).
        sample_prompt_tokens: validation tokens that prompt the sample when ``sample_prompt``
            is empty (at most ``data.seq_len`` of them: one validation sequence).
        sample_tokens: new tokens in that sample; 0 = no sample.
        sample_temperature: softmax temperature of the sample; 0 = greedy (argmax; a small
            model's greedy continuation soon repeats one phrase).
        sample_top_k: draw among the k likeliest tokens; 0 = no limit.
        sample_top_p: draw from the nucleus of probability mass p (Holtzman et al. 2020);
            1 = no limit.
    """

    interval: int = 50
    num_windows: int = 256
    num_batches: int = 4
    sample_prompt: str = ""
    sample_prompt_tokens: int = 48
    sample_tokens: int = 48
    sample_temperature: float = SAMPLE_TEMPERATURE
    sample_top_k: int = SAMPLE_TOP_K
    sample_top_p: float = SAMPLE_TOP_P

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``eval.<field>`` when a value is out of range."""
        _int_at_least("eval.interval", self.interval, 0)
        _int_at_least("eval.num_windows", self.num_windows, 0)
        _int_at_least("eval.num_batches", self.num_batches, 1)
        _int_at_least("eval.sample_tokens", self.sample_tokens, 0)
        _int_at_least("eval.sample_prompt_tokens", self.sample_prompt_tokens, 1)
        _int_at_least("eval.sample_top_k", self.sample_top_k, 0)
        temperature = self.sample_temperature
        if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
            raise UserError("eval.sample_temperature must be a finite number >= 0 (0 = greedy), "
                            f"got {temperature!r}")
        top_p = self.sample_top_p
        if not (_is_number(top_p) and 0 < top_p <= 1):
            raise UserError("eval.sample_top_p must be a number in (0, 1] (1 = no limit), "
                            f"got {top_p!r}")


def _is_number(value: object) -> bool:
    """An int or float, not a bool (TOML's ``true`` is no temperature)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(kw_only=True)
class LoggingConfig:
    """Where the run writes and how much it says.

    Attributes:
        run_dir: directory of metrics (JSONL), TensorBoard events, plots and, by default,
            checkpoints.
        log_interval: log metrics every this many steps (also at evaluations and the last
            step): a ``metrics.jsonl`` record, TensorBoard and W&B, and the progress bar or a
            plain line on stderr.
        tensorboard: also write TensorBoard events to ``<run_dir>/tensorboard``; needs the
            ``tensorboard`` extra (``pip install 'densetrain[tensorboard]'``). Without it the run
            says so once at start and writes the other logs.
        progress: a progress bar when stdout and stderr are terminals; otherwise (a pipe, a
            file, a batch job) or with ``progress=false`` a plain line per logged step.
        plot: write a loss-curve PNG at the end of the run.
        peak_tflops: peak TFLOP/s of one device that MFU divides by; 0 takes it from the
            accelerator table (GPU) or a matmul probe at start (CPU, best of several runs). A
            fixed figure keeps MFU comparable across runs on a shared machine, where the probe
            varies with load.
        sample_interval: also print the sample (``eval.sample_*``) every this many steps
            during training; 0 = only after the last step.
        wandb: also log every metrics record to Weights & Biases (the ``wandb`` extra), with
            the resolved job config as the W&B run config.
        wandb_project: W&B project name.
        wandb_name: W&B run name; empty = the name of ``run_dir``.
        wandb_dir: directory of W&B's local files; empty = ``run_dir``.
        wandb_mode: ``online``, ``offline`` (files only, ``wandb sync`` uploads them later) or
            ``disabled``; empty = the ``WANDB_MODE`` environment variable, else online.
    """

    run_dir: str = "runs/default"
    log_interval: int = 10
    tensorboard: bool = True
    progress: bool = True
    plot: bool = True
    peak_tflops: float = 0.0
    sample_interval: int = 0
    wandb: bool = False
    wandb_project: str = "densetrain"
    wandb_name: str = ""
    wandb_dir: str = ""
    wandb_mode: str = ""

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``logging.<field>`` when a value is out of range."""
        if not self.run_dir:
            raise UserError("logging.run_dir must be a non-empty directory path")
        _int_at_least("logging.log_interval", self.log_interval, 1)
        _int_at_least("logging.sample_interval", self.sample_interval, 0)
        if not (math.isfinite(self.peak_tflops) and self.peak_tflops >= 0):
            raise UserError(
                f"logging.peak_tflops must be a finite number >= 0 (0 = measure or look up), "
                f"got {self.peak_tflops}"
            )
        _choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        if self.wandb and not self.wandb_project:
            raise UserError("logging.wandb_project must be a non-empty W&B project name")
        if self.wandb and not _installed("wandb"):
            raise UserError(
                "logging.wandb=true needs the wandb package, which is not installed: "
                "pip install 'densetrain[wandb]' (or set --logging.wandb=false)"
            )


WANDB_MODES = ("", "online", "offline", "disabled")


def _installed(module: str) -> bool:
    """True when ``module`` can be imported (without importing it)."""
    import importlib.util
    import sys

    if module in sys.modules:  # None there: blocked, as if not installed
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"{name} must be one of {list(allowed)}, got {value!r}{hint}")


def _int_at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")


FAULT_ACTIONS = ("stop", "rollback")
SAVE_ERROR_ACTIONS = ("stop", "continue")


@dataclass(kw_only=True)
class FaultsConfig:
    """Faults that do not crash a run but ruin it: non-finite steps and loss spikes.

    The defaults follow PaLM §5.1 (Chowdhery et al., 2022): on a loss spike, restart from a
    checkpoint about 100 steps before it and skip 200-500 batches, the ones seen before and
    during the spike.

    Attributes:
        max_consecutive_skips: with ``training.nan_policy="skip"``, more than this many
            non-finite steps in a row trigger ``nan_cap_action``.
        max_skipped_steps: likewise for the run's total of skipped steps (kept in checkpoints).
        nan_cap_action: ``rollback`` (as on a loss spike) or ``stop`` the run with a message.
        spike_detection: watch the training loss for spikes.
        spike_window: steps of recent losses whose median and median absolute deviation (MAD)
            the detector compares each step's loss with.
        spike_threshold: a spike is a loss above the median by more than this many robust
            deviations (1.4826 × MAD, the standard deviation of a normal distribution).
        spike_min_deviation: floor of the robust deviation, as a fraction of the median (a
            flat loss has a MAD near 0, and noise would then look like a spike).
        spike_warmup_steps: no detection before this step (the early loss falls too fast).
        spike_min_history: no detection while the window holds fewer losses than this.
        spike_action: ``rollback`` to a checkpoint and skip batches, or ``stop``.
        divergence_margin: before ``spike_warmup_steps``, a training loss above the run's
            initial loss (the first step this process trains) by more than this many nats, or
            a non-finite one, is handled as a spike (``spike_action``; without a checkpoint to
            roll back to, the run stops naming the step and both losses); 0 turns it off.
        rollback_min_steps: roll back to the newest complete checkpoint at least this many
            steps before the spike.
        rollback_skip_batches: batches skipped after the checkpoint rolled back to, counted
            from it (so they cover the batches seen before and during the spike); must exceed
            ``rollback_min_steps``.
        max_rollbacks: more than this many rollbacks whose spikes lie within
            ``rollback_window_steps`` steps end the run.
        rollback_window_steps: the window of that cap, in steps.
        skip_sequences: ranges of the global sequence order the data stream never reads,
            ``"start:end,start:end"`` (end exclusive); rollbacks add theirs to the run's state.
        hang_watchdog: run a per-rank thread that ends a rank whose loop iteration (step,
            evaluation, callbacks) takes far longer than the recent ones, dumping every
            thread's Python stack and naming the rank and step.
        hang_factor: an iteration hangs past this many times the recent median iteration...
        hang_min_seconds: ...and past at least this many seconds (keep it above the longest
            checkpoint save and below ``parallel.collective_timeout_s``).
        hang_first_steps_seconds: the limit of the first iterations, before a median exists
            (compilation and warm-up).
        sdc_check_interval: every this many steps, compare a checksum of every parameter
            (bit-exact) across the data-parallel replicas that must hold the same values,
            naming the tensors and the ranks that disagree; 0 turns it off.
        sdc_check_optimizer: also compare the optimizer states (where they are replicated).
        sdc_action: on a mismatch ``stop`` (a launcher restarts without the bad host), or
            ``rollback`` to the newest checkpoint saved at or before the last passing check.
        sdc_replay_interval: every this many steps, run the step's forward/backward twice
            from the same inputs and compare loss and gradients (one more forward/backward
            and one gradient copy in memory); 0 (default) turns it off, because GPU kernels
            that are not deterministic need a tolerance measured on the hardware first.
        sdc_replay_tolerance: 0 compares bit for bit (CPU); else the largest difference
            allowed, relative to the tensor's largest magnitude.
        straggler_interval: every this many steps, all-gather each rank's per-step compute
            and collective-waiting times (`train.stragglers`; timestamps per step, one small
            all-gather per interval); 0 turns straggler detection off.
        straggler_factor: a rank whose compute time exceeds the median rank's by this
            factor...
        straggler_steps: ...for this many measured steps in a row is named a straggler (log,
            ``metrics.jsonl`` and ``densetrain goodput``).
    """

    max_consecutive_skips: int = 5
    max_skipped_steps: int = 50
    nan_cap_action: str = "rollback"
    spike_detection: bool = True
    spike_window: int = 100
    spike_threshold: float = 6.0
    spike_min_deviation: float = 0.01
    spike_warmup_steps: int = 100
    spike_min_history: int = 20
    spike_action: str = "rollback"
    divergence_margin: float = 5.0
    rollback_min_steps: int = 100
    rollback_skip_batches: int = 200
    max_rollbacks: int = 3
    rollback_window_steps: int = 1000
    skip_sequences: str = ""
    hang_watchdog: bool = True
    hang_factor: float = 10.0
    hang_min_seconds: float = 300.0
    hang_first_steps_seconds: float = 480.0
    sdc_check_interval: int = 100
    sdc_check_optimizer: bool = False
    sdc_action: str = "stop"
    sdc_replay_interval: int = 0
    sdc_replay_tolerance: float = 0.0
    straggler_interval: int = 10
    straggler_factor: float = 1.5
    straggler_steps: int = 5

    def validate(self) -> None:
        """Raise ``ValueError`` naming ``faults.<field>`` when a value is out of range."""
        for name in ("max_consecutive_skips", "max_skipped_steps", "spike_warmup_steps",
                     "max_rollbacks", "sdc_check_interval", "sdc_replay_interval"):
            _int_at_least(f"faults.{name}", getattr(self, name), 0)
        for name in ("spike_window", "spike_min_history", "rollback_min_steps",
                     "rollback_window_steps"):
            _int_at_least(f"faults.{name}", getattr(self, name), 1)
        _int_at_least("faults.rollback_skip_batches", self.rollback_skip_batches,
                      self.rollback_min_steps + 1 if isinstance(self.rollback_min_steps, int)
                      else 1)
        if self.spike_min_history > self.spike_window:
            raise UserError(
                f"faults.spike_min_history ({self.spike_min_history}) must be <= "
                f"faults.spike_window ({self.spike_window})"
            )
        for name in ("spike_threshold", "spike_min_deviation", "hang_factor",
                     "hang_min_seconds", "hang_first_steps_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UserError(f"faults.{name} must be a finite number > 0, got {value!r}")
        _choice("faults.nan_cap_action", self.nan_cap_action, FAULT_ACTIONS)
        _choice("faults.spike_action", self.spike_action, FAULT_ACTIONS)
        _choice("faults.sdc_action", self.sdc_action, FAULT_ACTIONS)
        margin = self.divergence_margin
        if not (isinstance(margin, (int, float)) and not isinstance(margin, bool)
                and math.isfinite(margin) and margin >= 0):
            raise UserError("faults.divergence_margin must be a finite number of nats >= 0 "
                            f"(0 turns the check off), got {margin!r}")
        tolerance = self.sdc_replay_tolerance
        if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance)
                and tolerance >= 0):
            raise UserError(f"faults.sdc_replay_tolerance must be a finite number >= 0, got "
                            f"{tolerance!r}")
        parse_sequence_ranges(self.skip_sequences, field_name="faults.skip_sequences")
        _int_at_least("faults.straggler_interval", self.straggler_interval, 0)
        _int_at_least("faults.straggler_steps", self.straggler_steps, 1)
        factor = self.straggler_factor
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                and math.isfinite(factor) and factor > 1):
            raise UserError("faults.straggler_factor must be a finite number > 1 (times the "
                            f"median rank's compute time), got {factor!r}")


def parse_sequence_ranges(text: str, *, field_name: str) -> list[tuple[int, int]]:
    """``"a:b,c:d"`` → ``[(a, b), (c, d)]`` (0 <= a < b); ``ValueError`` naming ``field_name``."""
    ranges = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        start, sep, end = part.partition(":")
        if not (sep and start.strip().isdigit() and end.strip().isdigit()
                and int(start) < int(end)):
            raise UserError(
                f"{field_name}: {part!r} is not a range 'start:end' of sequence positions with "
                "0 <= start < end (ranges separated by commas)"
            )
        ranges.append((int(start), int(end)))
    return ranges
