"""Bad config values fail before any work, naming the field, the value and what is allowed."""

import pytest

from densetrain.config import JobConfig, data_parallel_size, load_job_config


def _job(*overrides: str) -> JobConfig:
    return load_job_config(None, list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["--optim.lr=-3e-4"], r"optim.lr must be a finite number > 0, got -0.0003"),
    (["--optim.name=adam"], r"optim.name must be one of \['adamw', 'adafactor', 'sgd'\], "
                            r"got 'adam'; did you mean 'adamw'"),
    (["--schedule.name=cosin"], r"schedule.name must be one of .*did you mean 'cosine'"),
    (["--optim.betas=0.9"], r"optim.betas must be two numbers in \[0, 1\)"),
    (["--schedule.warmup_steps=300"], r"schedule.warmup_steps=300 must be shorter than the run "
                                      r"\(training.steps=300\); e.g. --schedule.warmup_steps=30"),
    (["--training.steps=20", "--schedule.warmup_steps=30"],
     r"warmup_steps=30 must be shorter .*training.steps=20\); e.g. --schedule.warmup_steps=2"),
    (["--parallel.pp=2", "--training.global_batch_size=3"],
     r"batch of 3 sequences .* does not split into 2 pipeline microbatches"),
    (["--training.micro_batch_size=5"], r"global_batch_size=16 is not divisible by "
                                        r"training.micro_batch_size x data-parallel size = 5 x 1"),
    (["--training.global_batch_tokens=1000"], r"global_batch_tokens=1000 is not divisible by "
                                              r"data.seq_len=256"),
    (["--training.global_batch_tokens=8192", "--training.global_batch_size=8"],
     r"global_batch_size=8 disagrees with .* = 32; set only one"),
    (["--schedule.warmup_steps=30", "--schedule.warmup_tokens=4096"],
     r"warmup_steps=30 and schedule.warmup_tokens=4096 are both set"),
    (["--training.dtype=fp16"], r"training.dtype must be one of \['fp32', 'bf16', 'float8'\]"),
    (["--training.device=tpu"], r"training.device must be"),
    (["--schedule.name=wsd", "--schedule.decay_fraction=0.95"], r"wsd decay steps 285"),
    (["--schedule.min_lr_ratio=1.5"], r"schedule.min_lr_ratio must be in \[0, 1\]"),
    (["--checkpoint.interval=0"], r"checkpoint.interval must be 'auto' or an integer >= 1, got 0"),
    (["--eval.sample_temperature=-1"], r"eval.sample_temperature must be a finite number >= 0"),
    (["--eval.sample_top_p=1.5"], r"eval.sample_top_p must be a number in \(0, 1\].*got 1.5"),
    (["--eval.sample_top_k=-3"], r"eval.sample_top_k"),
    (["--eval.sample_prompt_tokens=0"], r"eval.sample_prompt_tokens"),
    (["--parallel.pp_reshard_after_forward=false"],
     r"parallel.pp_reshard_after_forward=false .* needs pp > 1 \(got pp=1\)"),
    (["--model.preset=tiny-lama"], r"unknown model preset 'tiny-lama'.*tiny-llama"),
    (["--data.seq_len=512"], r"data.seq_len=512 exceeds the model's max_seq_len=256"),
    (["--schedule.batch_ramp_start=8", "--schedule.batch_ramp_tokens=9"],
     r"batch_ramp_start=8 must be a multiple of micro_batch_size × data-parallel size = 16"),
    (["--training.micro_batch_size=4", "--schedule.batch_ramp_start=4",
      "--schedule.batch_ramp_tokens=100", "--schedule.batch_ramp_increment=6"],
     r"batch_ramp_increment=6 must be a multiple of .* = 4"),
    (["--parallel.pp=2", "--schedule.batch_ramp_start=8", "--schedule.batch_ramp_tokens=9"],
     r"parallel.pp=2 needs a constant batch"),
    (["--schedule.name=rsqrt", "--schedule.warmup_steps=0"], r"rsqrt' needs schedule.warmup"),
    (["--optim.name=sgd", "--optim.fused=true"], r"optim.fused=true is only available"),
    (["--logging.peak_tflops=-1"], r"logging.peak_tflops must be a finite number >= 0"),
    (["--model.dim=100", "--model.num_heads=3"],
     r"^\[model\] num_heads \(3\) must divide dim \(100\)"),
    (["--model.preset=", "--model.vocab_size=10", "--model.dim=64", "--model.num_layers=2",
      "--model.num_heads=4", "--model.norm_eps=0"], r"^\[model\] norm_eps must be > 0, got 0"),
])
def test_bad_values_fail_with_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        _job(*overrides)


def test_world_size_rules():
    job = _job("--training.micro_batch_size=4")
    job.validate(world_size=4)  # dp_shard=-1 → dp 4: 16 = 4 × 4
    assert data_parallel_size(job, 4) == 4
    with pytest.raises(ValueError, match=r"micro_batch_size x data-parallel size = 4 x 8 = 32"):
        job.validate(world_size=8)
    job = _job("--parallel.tp=2", "--parallel.dp_shard=2", "--training.micro_batch_size=8")
    job.validate(world_size=4)
    with pytest.raises(ValueError, match=r"multiply to the world size: .* = 4, but world_size = 8"):
        job.validate(world_size=8)
    with pytest.raises(ValueError, match=r"parallel.tp=3 must divide the attention heads"):
        _job("--parallel.tp=3").validate(world_size=4)
    with pytest.raises(ValueError, match=r"tp=2 x pp=1 = 2 do not divide the world size 3") as e:
        _job("--parallel.tp=2").validate(world_size=3)
    assert "torchrun" not in str(e.value)  # several processes already: no launch hint
    # One process with a layout of several: how to start them.
    with pytest.raises(ValueError, match=r"this is one process: start 2 with `torchrun "
                                         r"--standalone --nproc-per-node=2 -m densetrain train"):
        _job("--parallel.tp=2").validate(world_size=1)
    with pytest.raises(ValueError, match=r"start 4 with `torchrun --standalone --nproc-per-node=4"):
        job.validate(world_size=1)


def test_warmup_tokens_and_ramp_resolve_to_steps():
    job = _job("--schedule.warmup_steps=0", "--schedule.warmup_tokens=40960",
               "--training.micro_batch_size=4", "--schedule.batch_ramp_start=4",
               "--schedule.batch_ramp_tokens=20480")
    schedule = job.batch_size_schedule(dp_size=1)
    # 3 increments of 4 sequences (micro 4 × dp 1), one per 20480 / 3 tokens; 256 per sequence
    assert [schedule.batch_size_at(s) for s in range(15)] == [4] * 7 + [8] * 4 + [12] * 2 + [16] * 2
    assert job.schedule.warmup_tokens == 0
    assert job.schedule.warmup_steps == schedule.steps_for_tokens(40960)
    assert schedule.tokens_before(job.schedule.warmup_steps) >= 40960
    assert schedule.tokens_before(job.schedule.warmup_steps - 1) < 40960
    job.validate()  # idempotent once resolved


def test_model_section_builds_from_preset_or_fields():
    job = _job()
    assert job.build_model_config(vocab_size=777).vocab_size == 777  # tiny: tokenizer's vocab
    job = _job("--model.vocab_size=500")
    assert job.build_model_config(vocab_size=777).vocab_size == 500  # an explicit value wins
    gpt2 = _job("--model.preset=gpt2-124m")
    assert gpt2.build_model_config(vocab_size=777).vocab_size == 50257  # a real vocab stays
    explicit = _job("--model.preset=", "--model.dim=64", "--model.num_layers=2",
                    "--model.num_heads=4")
    assert explicit.build_model_config(vocab_size=99).dim == 64
    with pytest.raises(ValueError, match=r"must set \['vocab_size'\]"):
        explicit.build_model_config(vocab_size=None)
    with pytest.raises(ValueError, match="num_kv_heads"):
        _job("--model.num_kv_heads=3")
