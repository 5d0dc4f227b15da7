"""TOML loading, overrides, printing/saving round trips and unknown-key errors."""

import re
from pathlib import Path

import pytest
import tomllib

from densetrain.config import (
    JobConfig,
    default_job_config,
    job_config_from_dict,
    job_config_to_toml,
    load_job_config,
    save_job_config,
)
from densetrain.models.config import RopeScaling

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
WORLD_SIZES = {"default.toml": 1, "gpt2-124m.toml": 8, "llama3-8b.toml": 8,
               "gpt3-175b.toml": 64, "megatron-175b-sp.toml": 64, "palm-8b.toml": 8,
               "llama3-70b.toml": 512, "llama3-405b.toml": 8192, "neox-20b.toml": 96,
               "bloom-176b.toml": 384, "palm-540b.toml": 6144, "gopher-280b.toml": 4096,
               "opt-175b.toml": 992}


def test_default_toml_is_the_embedded_default():
    assert load_job_config(CONFIGS / "default.toml") == load_job_config(None)
    assert load_job_config(None) == default_job_config().resolve()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_every_shipped_config_loads_validates_and_round_trips(name, tmp_path):
    job = load_job_config(CONFIGS / name)
    job.validate(world_size=WORLD_SIZES[name])
    job.build_model_config(vocab_size=1000)
    saved = save_job_config(job, tmp_path / "config.toml")
    assert load_job_config(saved) == job
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_paper_hyperparameters():
    gpt2 = load_job_config(CONFIGS / "gpt2-124m.toml")
    assert (gpt2.optim.lr, gpt2.optim.betas, gpt2.optim.weight_decay) == (6e-4, [0.9, 0.95], 0.1)
    assert gpt2.training.global_batch_size * gpt2.data.seq_len == 524_288
    llama = load_job_config(CONFIGS / "llama3-8b.toml", world_size=8)
    assert (llama.optim.lr, llama.schedule.warmup_steps, llama.training.steps) == (
        3e-4, 8000, 1_200_000)
    assert llama.data.seq_len == 8192 and llama.optim.grad_clip == 1.0
    ramp = llama.batch_size_schedule(dp_size=8)
    assert ramp.batch_size_at(0) * 8192 == 8 * 2**20
    assert ramp.batch_size_at(llama.training.steps - 1) * 8192 == 16 * 2**20
    assert llama.build_model_config(None).num_kv_heads == 8


def test_overrides_are_coerced_from_the_annotations():
    job = load_job_config(None, [
        "--optim.lr=1e-3", "--optim.betas=0.9,0.99", "--optim.fused=false",
        "--training.steps", "40", "--training.compile", "--data.weights=[0.5]",
        "--model.num_layers=2", "--model.rope_scaling={factor = 4.0}",
        "--model.rope_scaling.original_max_seq_len=512", "--eval.sample_prompt='x = 1'",
        "--training.global_batch_tokens=4.096e3", "--schedule.warmup_steps=4",
    ])
    assert job.optim.lr == 1e-3 and job.optim.betas == [0.9, 0.99] and job.optim.fused is False
    assert job.training.steps == 40 and job.training.compile is True
    assert job.data.weights == [0.5] and job.model.num_layers == 2
    assert job.model.rope_scaling == RopeScaling(factor=4.0, original_max_seq_len=512)
    assert job.eval.sample_prompt == "x = 1"
    assert job.training.global_batch_size == 16  # 4096 tokens / seq_len 256
    model_cfg = job.build_model_config(vocab_size=300)
    assert model_cfg.num_layers == 2 and model_cfg.vocab_size == 300
    assert model_cfg.rope_scaling.factor == 4.0
    assert load_job_config(None, ["--optim.fused=none"]).optim.fused is None


@pytest.mark.parametrize("override, message", [
    ("--optim.lrr=1", r"unknown key 'optim.lrr' in override '--optim.lrr=1'; did you mean 'lr'"),
    ("--optimizer.lr=1", r"unknown key 'optimizer'.*did you mean 'optim'"),
    ("--model.rope_scaling.factr=2", r"'model.rope_scaling.factr'.*did you mean 'factor'"),
    ("--training.steps=ten", r"training.steps expects an integer, got 'ten'"),
    ("--training.compile=maybe", r"training.compile expects a boolean"),
    ("--optim.betas=[0.9", r"optim.betas.*not a valid TOML value"),
    ("optim.lr=1", r"must look like --section.field=value"),
    ("--optim=1", r"must be section.field"),
])
def test_bad_overrides_name_the_override(override, message):
    with pytest.raises(ValueError, match=message):
        load_job_config(None, [override])


@pytest.mark.parametrize("words, attribute, expected", [
    (["--steps=5"], ("training", "steps"), 5),
    (["--lr", "0.002"], ("optim", "lr"), 0.002),
    (["--set", "training.steps=7"], ("training", "steps"), 7),
])
def test_a_key_without_its_section_suggests_an_override_that_works(words, attribute, expected):
    with pytest.raises(ValueError, match="must be section.field") as caught:
        load_job_config(None, words)
    suggestions = re.findall(r"(?:did you mean|write) (--[\w.]+=\S+?)\??$", str(caught.value))
    assert suggestions, str(caught.value)
    job = load_job_config(None, [suggestions[0]])
    assert getattr(getattr(job, attribute[0]), attribute[1]) == expected


def test_a_field_in_the_wrong_section_names_its_section(tmp_path):
    with pytest.raises(ValueError, match=r"it is a field of \[optim\]") as caught:
        load_job_config(None, ["--training.grad_clip=0.5"])
    suggestion = re.search(r"(--optim\.grad_clip=\S+)$", str(caught.value)).group(1)
    assert load_job_config(None, [suggestion]).optim.grad_clip == 0.5
    path = tmp_path / "moved.toml"
    path.write_text("[training]\ngrad_clip = 0.5\n")
    with pytest.raises(ValueError, match=r"moved.toml.*grad_clip belongs in \[optim\]"):
        load_job_config(path)


def test_a_field_outside_any_section_names_its_section_and_moving_it_works(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("steps = 7\n")
    with pytest.raises(ValueError, match=r"flat.toml.*steps is a field: put it under \[training\]"):
        load_job_config(path)
    path.write_text("[training]\nsteps = 7\n")
    assert load_job_config(path).training.steps == 7


def test_a_directory_or_binary_file_as_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"config file .* is a directory; give a TOML file"):
        load_job_config(tmp_path)
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"binary.toml' is not valid TOML: not UTF-8 text"):
        load_job_config(path)


def test_a_key_in_several_sections_names_each():
    with pytest.raises(ValueError, match=r"--data.seed=3 or --training.seed=3"):
        load_job_config(None, ["--seed=3"])


def test_config_given_as_an_option_points_to_the_positional_file():
    with pytest.raises(ValueError, match=r"not an option: densetrain train run.toml"):
        load_job_config(None, ["--config", "run.toml"])


def test_a_section_alone_lists_its_fields():
    with pytest.raises(ValueError, match=r"\[optim\] is a section.*--optim.FIELD=1.*lr"):
        load_job_config(None, ["--optim=1"])


def test_unknown_keys_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nweight_decy = 0.1\n")
    message = (r"unknown key 'optim.weight_decy' in config file '.*bad.toml'; "
               r"did you mean 'weight_decay'")
    with pytest.raises(ValueError, match=message):
        load_job_config(path)
    path.write_text("[trainig]\nsteps = 3\n")
    message = r"unknown key 'trainig' in config file '.*bad.toml'; did you mean 'training'"
    with pytest.raises(ValueError, match=message):
        load_job_config(path)
    path.write_text("[training]\nsteps = 3.5\n")
    with pytest.raises(ValueError, match=r"bad.toml.*training.steps expects an integer"):
        load_job_config(path)
    path.write_text("[training\nsteps = 3\n")
    with pytest.raises(ValueError, match=r"bad.toml.*not valid TOML.*line 1"):
        load_job_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_job_config(tmp_path / "missing.toml")


def test_toml_text_round_trips_awkward_values():
    job = JobConfig()
    job.eval.sample_prompt = 'say "hi"\n\tthen \\ leave \x7f é'
    job.model.extra = {"family": "x", "odd key": [1, 2.5, True]}
    job.model.norm_eps = 1e-6
    job.optim.fused = True
    text = job_config_to_toml(job)
    assert job_config_from_dict(tomllib.loads(text), validate=False) == job
    assert "[model]\npreset = \"tiny-llama\"" in text


def test_job_config_pickles_for_spawned_ranks():
    import copy
    import pickle

    job = load_job_config(None, ["--model.num_layers=3"])
    assert pickle.loads(pickle.dumps(job)) == job and copy.deepcopy(job) == job
