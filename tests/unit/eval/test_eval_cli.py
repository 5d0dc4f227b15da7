"""`densetrain eval perplexity | tasks` and `densetrain generate` end to end, and model loading
from densetrain, Hugging Face and training-checkpoint directories."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from densetrain.checkpoint import ModelState, save_checkpoint
from densetrain.cli.main import main
from densetrain.config import default_job_config, job_config_to_toml
from densetrain.eval import PerplexityConfig, evaluate_task, file_perplexity, load_for_eval
from densetrain.eval.tasks import load_jsonl_task
from densetrain.generate import generate
from densetrain.models import Transformer
from densetrain.models.hf import save_model

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def native_dir(hf_pair, tmp_path_factory):
    """The Hugging Face fixture saved as a densetrain model directory with its tokenizer."""
    _, model, hf_dir = hf_pair
    directory = tmp_path_factory.mktemp("native") / "model"
    save_model(model, directory)
    shutil.copyfile(hf_dir / "tokenizer.json", directory / "tokenizer.json")
    return directory


def test_perplexity_command_prints_and_writes_the_library_result(
    native_dir, hf_pair, tokenizer, tmp_path, capsys
):
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    out = tmp_path / "ppl.json"
    code = main(["eval", "perplexity", str(native_dir), "--text", str(text), "--stride", "16",
                 "--json", "-o", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    expected = file_perplexity(hf_pair[1], tokenizer, [text], PerplexityConfig(stride=16))
    assert record["bits_per_byte"] == pytest.approx(expected.bits_per_byte, rel=1e-6)
    assert record["tokens"] == expected.tokens and record["bytes"] == len(TEXT.encode())


def test_tasks_command_reports_acc_and_acc_norm(native_dir, hf_pair, tokenizer, tmp_path):
    rows = [{"context": "import", "choices": ["os", "sys"], "label": i % 2} for i in range(4)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tasks.json"
    code = main(["eval", "tasks", str(native_dir), "--task", str(path), "--shots", "1",
                 "-o", str(out)])
    assert code == 0
    (record,) = json.loads(out.read_text())["results"]
    expected = evaluate_task(hf_pair[1], tokenizer, load_jsonl_task(path), shots=1)
    assert record["acc"] == expected.acc
    assert record["acc_norm"] == expected.acc_norm and record["shots"] == 1


def test_generate_command_is_the_library_generation(native_dir, hf_pair, tokenizer, capsys):
    code = main(["generate", str(native_dir), "--prompt", "def ", "--max-new-tokens", "6",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    ids = tokenizer.encode("def ")
    # --top-p not given: sampling takes the default nucleus 0.95
    out = generate(hf_pair[1], torch.tensor([ids]), 6, temperature=0.8, top_k=20, top_p=0.95,
                   eos_token_id=tokenizer.eos_id,
                   generator=torch.Generator().manual_seed(3))[0, len(ids):].tolist()
    if tokenizer.eos_id in out:
        out = out[: out.index(tokenizer.eos_id)]
    assert record["completions"] == [tokenizer.decode(out)]


def test_generate_samples_by_default_and_is_greedy_at_temperature_0(native_dir, hf_pair,
                                                                   tokenizer, capsys):
    """No sampling flag: temperature 0.8, top-k 40, top-p 0.95, seed 0 (the same text on each
    call); ``--temperature 0`` is the greedy continuation."""
    ids = tokenizer.encode("def ")

    def completion(*flags: str) -> str:
        assert main(["generate", str(native_dir), "--prompt", "def ", "--max-new-tokens", "8",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["completions"][0]

    def library(**sampling) -> str:
        out = generate(hf_pair[1], torch.tensor([ids]), 8, eos_token_id=tokenizer.eos_id,
                       **sampling)[0, len(ids):].tolist()
        return tokenizer.decode(out[: out.index(tokenizer.eos_id)]
                                if tokenizer.eos_id in out else out)

    default = completion()
    assert default == completion()  # seeded: reproducible
    assert default == library(temperature=0.8, top_k=40, top_p=0.95,
                              generator=torch.Generator().manual_seed(0))
    assert completion("--temperature", "0") == library()


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["eval", "perplexity", str(tmp_path), "--text", "x"]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_hf_directory_loads_with_its_tokenizer(hf_pair):
    hf_model, _, hf_dir = hf_pair
    model, tok = load_for_eval(hf_dir, device="cpu")
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model(ids).logits, atol=1e-4, rtol=1e-4)


def test_training_checkpoint_loads_from_run_or_step_directory(tokenizer, tmp_path):
    job = default_job_config()
    job.data.tokenizer = tokenizer.path
    job.data.cache_dir = str(tmp_path / "no-corpus")  # its tokenizer is the job's own
    job.model.preset = "tiny-llama"
    model = Transformer(job.build_model_config(tokenizer.vocab_size))
    model.init_weights(seed=5)
    step_dir = save_checkpoint(tmp_path / "run" / "checkpoints", 7, {"model": ModelState(model)},
                               config_toml=job_config_to_toml(job))
    for path in (tmp_path / "run", step_dir):
        loaded, tok = load_for_eval(path, device="cpu")
        assert tok.fingerprint == tokenizer.fingerprint
        for name, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name


def test_windows_past_learned_positions_are_refused_naming_the_flags(tokenizer, tmp_path,
                                                                      capsys):
    """A GPT-2-style model (learned positions, max_seq_len 16): --seq-len and --max-new-tokens
    past its positions name the flag and how far they may go; inside them both run."""
    import shutil

    from densetrain.cli.main import main
    from densetrain.models.hf import save_model
    from densetrain.models.presets.gpt2 import gpt2_config

    model = Transformer(gpt2_config(dim=32, num_layers=1, num_heads=2, published_params=0,
                                    vocab_size=tokenizer.vocab_size, max_seq_len=16))
    model.init_weights(seed=0)
    save_model(model, tmp_path / "gpt")
    shutil.copyfile(tokenizer.path, tmp_path / "gpt" / "tokenizer.json")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    prompt_ids = len(tokenizer.encode("def"))
    for args, expected in (
        (["eval", "perplexity", "--seq-len", "64"], "--seq-len 64 exceeds max_seq_len 16"),
        (["eval", "perplexity", "--stride", "20"], "--stride 20 exceeds the window of 16"),
        (["generate", "--prompt", "def", "--max-new-tokens", "40"],
         f"give --max-new-tokens {16 - prompt_ids} or less"),
    ):
        argv = [*args[:2], str(tmp_path / "gpt"), *args[2:]] if args[0] == "eval" else [
            args[0], str(tmp_path / "gpt"), *args[1:]]
        if args[0] == "eval":
            argv += ["--text", str(text)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert main(["eval", "perplexity", str(tmp_path / "gpt"), "--text", str(text),
                 "--seq-len", "16"]) == 0
    assert main(["generate", str(tmp_path / "gpt"), "--prompt", "def", "--max-new-tokens",
                 str(16 - prompt_ids)]) == 0
