"""Every bad input a user can give a `densetrain` command ends in one message, not a traceback.

Each case builds a real bad input (a missing path, a malformed JSONL line, a truncated file, a
NaN weight, a damaged checkpoint...) and runs the command through `main`; the message must name
the file, line or field, the exit code must be non-zero, no traceback may be printed, and every
``--flag`` a hint names must exist on the command line.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from densetrain.checkpoint import ModelState, save_checkpoint
from densetrain.cli.main import build_parser, main
from densetrain.config import default_job_config, job_config_to_toml
from densetrain.data import PrepareConfig, prepare_dataset, train_tokenizer
from densetrain.models import Transformer
from densetrain.models.hf import save_model

WORDS = "the of and to in is that for it as was with be by on not this are or from at which".split()


def _documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=120)) + f" {i}." for i in range(count)]


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _tiny_model(vocab_size: int) -> Transformer:
    job = default_job_config()
    job.model.preset = "tiny-llama"
    model = Transformer(job.build_model_config(vocab_size))
    model.init_weights(seed=3)
    return model


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace of good and bad inputs (see each case for the bad one it uses)."""
    root = tmp_path_factory.mktemp("ws")
    docs = _documents(40, seed=0)
    (root / "raw").mkdir()
    for i, doc in enumerate(docs):
        (root / "raw" / f"d{i:03d}.txt").write_text(doc)
    tok = train_tokenizer(docs, root / "tok" / "tokenizer.json", vocab_size=300)
    prepare_dataset([str(root / "raw")], root / "ds", tokenizer=tok, cfg=PrepareConfig())
    (root / "bad.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    (root / "nofield.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (root / "empty.txt").write_text("")
    (root / "afile").write_text("not a directory")
    (root / "c.parquet").write_bytes(b"")
    (root / "model_bad.toml").write_text("dim 64\n")
    (root / "fit_bad.json").write_text("{not json\n")
    (root / "fit_list.json").write_text("[1]\n")
    (root / "model_list.json").write_text("[1, 2]\n")
    (root / "model_partial.toml").write_text("[model]\ndim = 64\n")
    (root / "model_typo.toml").write_text("dimm = 64\nnum_layers = 2\nnum_heads = 4\n"
                                          "vocab_size = 1000\n")
    (root / "model_type.toml").write_text('dim = "wide"\nnum_layers = 2\nnum_heads = 4\n'
                                          "vocab_size = 1000\n")
    _write_parquet(root / "t.parquet")
    _model_dirs(root, tok)
    _checkpoints(root, tok)
    _swapped_shard_dataset(root, tok)
    return root


def _write_parquet(path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a document"]}), path)


def _model_dirs(root: Path, tok) -> None:
    model = _tiny_model(tok.vocab_size)
    save_model(model, root / "native")
    shutil.copyfile(tok.path, root / "native" / "tokenizer.json")
    shutil.copytree(root / "native", root / "native_trunc")
    _truncate(root / "native_trunc" / "model.safetensors")
    with torch.no_grad():
        model.layers["0"].mlp.w_up.weight[3, 2] = float("nan")
    save_model(model, root / "native_nan")
    shutil.copyfile(tok.path, root / "native_nan" / "tokenizer.json")
    with torch.no_grad():  # finite weights whose logits overflow float32
        model.layers["0"].mlp.w_up.weight[3, 2] = 0.0
        model.output.weight.fill_(3e38)
    save_model(model, root / "native_overflow")
    shutil.copyfile(tok.path, root / "native_overflow" / "tokenizer.json")
    (root / "native_badjson").mkdir()
    (root / "native_badjson" / "config.json").write_text('{"dim": 64,\n  "num_layers": }\n')


def _checkpoints(root: Path, tok) -> None:
    job = default_job_config()
    job.model.preset = "tiny-llama"
    job.data.tokenizer = tok.path
    job.data.cache_dir = str(root / "no-corpus")  # its tokenizer is the job's own
    step = save_checkpoint(root / "run" / "checkpoints", 2, {"model": ModelState(
        _tiny_model(tok.vocab_size))}, config_toml=job_config_to_toml(job))
    shutil.copytree(step, root / "ckpt_trunc")
    for shard in (root / "ckpt_trunc").glob("*.distcp"):
        _truncate(shard, 0.3)
    shutil.copytree(step, root / "ckpt_garbage")
    (root / "ckpt_garbage" / ".metadata").write_bytes(bytes(range(256)) * 3)


def _swapped_shard_dataset(root: Path, tok) -> None:
    """``ds`` with its shard replaced by tokens of another tokenizer of the same vocabulary size,
    cut to the same byte size (the swap a size check cannot see)."""
    other_docs = _documents(60, seed=9)
    other = train_tokenizer([d.upper() for d in other_docs], root / "tok2" / "tokenizer.json",
                            vocab_size=300)
    assert other.vocab_size == tok.vocab_size and other.fingerprint != tok.fingerprint
    (root / "raw2").mkdir()
    (root / "raw2" / "a.txt").write_text("\n".join(d.upper() for d in other_docs))
    prepare_dataset([str(root / "raw2")], root / "ds_other", tokenizer=other)
    shutil.copytree(root / "ds", root / "ds_swapped")
    target = root / "ds_swapped" / "train" / "00000.bin"
    foreign = (root / "ds_other" / "train" / "00000.bin").read_bytes()
    assert len(foreign) >= target.stat().st_size
    target.write_bytes(foreign[: target.stat().st_size])


TRAIN = ["--training.steps=2", "--schedule.warmup_steps=0", "--model.preset=tiny-llama",
         "--data.seq_len=16", "--training.global_batch_size=2", "--training.micro_batch_size=2",
         "--logging.progress=false", "--logging.plot=false", "--logging.tensorboard=false"]

# (case, command line, words the message must contain); {ws} is the workspace, {tok} its
# tokenizer, {out} a fresh output path of the case
CASES = [
    ("prepare-missing-path", "data prepare {ws}/missing -o {out} --tokenizer {tok}",
     ["missing", "does not exist"]),
    ("prepare-empty-file", "data prepare {ws}/empty.txt -o {out} --tokenizer {tok}",
     ["empty.txt", "no document"]),
    ("prepare-malformed-jsonl", "data prepare {ws}/bad.jsonl -o {out} --tokenizer {tok}",
     ["bad.jsonl:2", "malformed JSON", "--on-bad-line=skip"]),
    ("prepare-missing-field", "data prepare {ws}/nofield.jsonl -o {out} --tokenizer {tok}",
     ["nofield.jsonl:1", "no field 'text'", "body"]),
    ("prepare-missing-column", "data prepare {ws}/t.parquet -o {out} --tokenizer {tok}",
     ["t.parquet", "no column 'text'", "content", "--text-field"]),
    ("prepare-not-parquet", "data prepare {ws}/c.parquet -o {out} --tokenizer {tok}",
     ["c.parquet", "not a readable Parquet file"]),
    ("prepare-missing-tokenizer", "data prepare {ws}/raw -o {out} --tokenizer {ws}/nope.json",
     ["nope.json", "does not exist"]),
    ("prepare-glob-no-match", "data prepare {ws}/raw/*.md -o {out} --tokenizer {tok}",
     ["*.md", "matches no files"]),
    ("prepare-existing-dataset", "data prepare {ws}/raw -o {ws}/ds --tokenizer {tok}",
     ["already a prepared dataset", "--overwrite"]),
    ("inspect-missing-dir", "data inspect {ws}/nodir", ["nodir", "does not exist"]),
    ("verify-swapped-shard", "data verify {ws}/ds_swapped", ["00000.bin", "does not match"]),
    ("tokenizer-empty-corpus", "data train-tokenizer {ws}/empty.txt -o {out}/tokenizer.json "
     "--vocab-size 300", ["corpus is empty"]),
    ("tokenizer-special-tokens", "data train-tokenizer {ws}/raw -o {out}/tokenizer.json "
     "--vocab-size 300 --special-tokens a,b", ["--special-tokens", "three"]),
    ("train-missing-dataset", "train --data.datasets=[\"{ws}/nodir\"] --logging.run_dir={out}",
     ["data.datasets", "nodir", "does not exist"]),
    ("train-swapped-shard", "train --data.datasets=[\"{ws}/ds_swapped\"] --logging.run_dir={out}",
     ["00000.bin", "does not match its checksum"]),
    ("train-run-dir-is-file", "train --data.datasets=[\"{ws}/ds\"] --logging.run_dir={ws}/afile",
     ["logging.run_dir", "afile", "not a directory"]),
    ("train-vocab-exceeds-model", "train --data.datasets=[\"{ws}/ds\"] --model.vocab_size=256 "
     "--logging.run_dir={out}", ["model.vocab_size=256", "300"]),
    ("convert-truncated", "convert --to-hf {ws}/native_trunc --out {out} --family llama",
     ["model.safetensors", "truncated"]),
    ("convert-nan", "convert --to-hf {ws}/native_nan --out {out} --family llama",
     ["native_nan", "layers.0.mlp.w_up.weight", "NaN"]),
    ("convert-bad-json", "convert --to-hf {ws}/native_badjson --out {out} --family llama",
     ["config.json:2", "malformed JSON"]),
    ("convert-not-hf", "convert --from-hf {ws}/native --out {out}", ["model_type"]),
    ("convert-out-not-empty", "convert --from-hf {ws}/native --out {ws}/raw", []),
    ("eval-nan", "eval perplexity {ws}/native_nan --text {ws}/raw/d000.txt",
     ["layers.0.mlp.w_up.weight", "NaN"]),
    ("eval-non-finite-loss", "eval perplexity {ws}/native_overflow --text {ws}/raw/d000.txt",
     ["native_overflow", "non-finite", "--dtype"]),
    ("eval-stride-past-window", "eval perplexity {ws}/native --text {ws}/t.parquet "
     "--text-field content --seq-len 8 --stride 9", ["--stride 9 exceeds the window of 8"]),
    ("eval-empty-text", "eval perplexity {ws}/native --text {ws}/empty.txt",
     ["empty.txt", "no text to score", "0 tokens"]),
    ("eval-missing-text", "eval perplexity {ws}/native --text {ws}/none.txt", ["none.txt"]),
    ("generate-truncated-shard", "generate {ws}/ckpt_trunc --prompt x",
     ["ckpt_trunc is damaged", ".distcp", "truncated or overwritten"]),
    ("generate-garbage-metadata", "generate {ws}/ckpt_garbage --prompt x",
     ["ckpt_garbage is damaged", ".metadata:", "the manifest says"]),
    ("generate-not-a-model", "generate {ws}/raw --prompt x", ["not a model directory"]),
    ("generate-top-p-above-1", "generate {ws}/native --prompt x --temperature 1 --top-p 1.5",
     ["--top-p", "(0, 1]", "1.5"]),
    ("generate-top-k-negative", "generate {ws}/native --prompt x --temperature 1 --top-k -3",
     ["--top-k", "positive integer", "-3"]),
    ("generate-no-samples", "generate {ws}/native --prompt x --num-samples 0",
     ["--num-samples", "positive integer"]),
    ("generate-top-p-when-greedy", "generate {ws}/native --prompt x --temperature 0 --top-p 0.9",
     ["--top-p", "needs sampling", "--temperature"]),
    ("generate-samples-when-greedy",
     "generate {ws}/native --prompt x --temperature 0 --num-samples 3",
     ["--num-samples 3", "greedy", "--temperature"]),
    ("generate-no-such-device", "generate {ws}/native --prompt x --device tpu",
     ["--device tpu is not a device", "cpu, cuda"]),
    ("model-info-zero-seq", "model-info gpt2-124m --seq-len 0",
     ["--seq-len must be a positive integer", "1024", "got 0"]),
    ("plan-unknown-preset", "plan --model gpt9 --devices 8", ["'gpt9'", "densetrain presets"]),
    ("plan-model-not-toml", "plan --model {ws}/model_bad.toml --devices 8",
     ["--model", "model_bad.toml", "not valid TOML", "line 1"]),
    ("plan-model-not-a-table", "plan --model {ws}/model_list.json --devices 8",
     ["model_list.json", "ModelConfig fields", "got a list"]),
    ("plan-model-missing-fields", "plan --model {ws}/model_partial.toml --devices 8",
     ["model_partial.toml", "vocab_size, num_layers, num_heads"]),
    ("plan-model-unknown-field", "plan --model {ws}/model_typo.toml --devices 8",
     ["model_typo.toml", "'model.dimm'", "did you mean 'dim'"]),
    ("plan-model-wrong-type", "plan --model {ws}/model_type.toml --devices 8",
     ["model_type.toml", "model.dim expects an integer", "'wide'"]),
    ("plan-calibrate-ranks-alone", "plan --model gpt2-124m --devices 8 --calibrate-ranks 4",
     ["--calibrate-ranks needs --calibrate"]),
    ("scaling-fit-missing-csv", "scaling fit {ws}/none.csv", ["none.csv", "does not exist"]),
    ("scaling-optimal-missing-fit", "scaling optimal --flops 1e21 --fit {ws}/nofit.json",
     ["nofit.json does not exist", "scaling fit"]),
    ("scaling-optimal-bad-fit", "scaling optimal --flops 1e21 --fit {ws}/fit_bad.json",
     ["fit_bad.json is not valid JSON", "line 1"]),
    ("scaling-optimal-fit-not-object", "scaling optimal --flops 1e21 --fit {ws}/fit_list.json",
     ["fit_list.json must hold a JSON object", "got a list"]),
    ("goodput-not-a-run", "goodput {ws}/raw", ["goodput.jsonl does not exist"]),
    ("train-key-without-section", "train --steps=5", ["'steps'", "--training.steps=5"]),
    ("train-config-as-option", "train --config {ws}/run.toml",
     ["not an option", "/run.toml [--section.field=value"]),
]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of all its sub-commands."""
    found = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


@pytest.mark.parametrize(("line", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_message_naming_it(ws, tmp_path, capsys, line, words):
    tok = ws / "tok" / "tokenizer.json"
    argv = [part.format(ws=ws, tok=tok, out=tmp_path / "out") for part in line.split()]
    if argv[0] == "train":
        argv += TRAIN
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("densetrain ")]
    assert len(lines) == 1 and ": error: " in lines[0], err
    for word in words:
        assert word in err, (word, err)
    known = _options(build_parser())
    hints = re.sub(r"override '[^']*'", "", err)  # the user's own words, echoed
    for flag in re.findall(r"(?<![\w.-])(--[a-z][a-z-]*[a-z])\b(?![.\w])", hints):
        assert flag in known, f"the message names {flag}, which no command has: {err}"


def test_run_dir_on_a_read_only_disk(tmp_path, capsys):
    mount = _mount_tmpfs(tmp_path / "ro", "ro,size=1m")
    try:
        code = main(["train", f"--logging.run_dir={mount}/run", *TRAIN])
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "logging.run_dir" in err and "Read-only file system" in err


def test_disk_full_while_preparing_and_converting(ws, tmp_path, capsys):
    mount = _mount_tmpfs(tmp_path / "full", "size=48k")
    try:
        big = tmp_path / "big.txt"
        big.write_text(" ".join(_documents(400, seed=2)))
        prepare = ["data", "prepare", str(big), "-o", f"{mount}/ds",
                   "--tokenizer", str(ws / "tok" / "tokenizer.json")]
        assert main(prepare) == 2
        err = capsys.readouterr().err
        assert "no space left on device" in err and "Traceback" not in err
        assert not (mount / "ds" / "meta.json").exists()
        assert main(["convert", "--to-hf", str(ws / "native"), "--out", f"{mount}/hf",
                     "--family", "llama"]) == 2
        err = capsys.readouterr().err
        assert "no space left on device" in err and f"{mount}/hf" in err
        assert not (mount / "hf").exists() and not list(mount.glob(".hf.tmp-*"))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _mount_tmpfs(path: Path, options: str) -> Path:
    """A small real tmpfs at ``path``; skips where this process may not mount one."""
    path.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return path


def test_debug_flag_shows_the_traceback(ws, capsys):
    argv = ["data", "inspect", str(ws / "nodir")]
    assert main(["--debug", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "FileNotFoundError" in err
    assert main([*argv, "--debug"]) == 2  # anywhere on the line
    assert "Traceback" in capsys.readouterr().err


def test_compile_without_a_cpp_compiler_is_refused_before_the_model(ws, tmp_path, capsys):
    # inductor's compiler search (the setting $CXX feeds) pointed at a compiler that is not
    # there, through inductor's own config.patch (which restores it after)
    from torch._inductor import config as inductor_config

    missing = str(tmp_path / "no-such-g++")
    argv = ["train", f'--data.datasets=["{ws / "ds"}"]', f"--logging.run_dir={tmp_path / 'run'}",
            "--training.compile=true", *TRAIN]
    with inductor_config.patch({"cpp.cxx": (None, missing)}):
        assert main(argv) == 2
    assert inductor_config.cpp.cxx != (None, missing)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "InductorError" not in err
    line, = [x for x in err.splitlines() if x.startswith("densetrain ")]
    assert "error: training.compile=true on CPU needs a C++ compiler" in line, err
    assert missing in line and "--training.compile=false" in line
    assert not list((tmp_path / "run").glob("*"))  # refused before any work: nothing written


def test_console_script_reports_without_traceback(ws):
    done = subprocess.run([sys.executable, "-m", "densetrain", "data", "inspect",
                           str(ws / "nodir")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
