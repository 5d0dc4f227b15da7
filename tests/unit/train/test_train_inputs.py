"""`densetrain.train.train(job)` called from Python refuses a job whose inputs cannot work with
the same one line that `densetrain train` prints, before any work (no process group, no run
lock, nothing written in the run directory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from densetrain.cli.main import main
from densetrain.config import load_job_config
from densetrain.data import PrepareConfig, prepare_dataset, train_tokenizer
from densetrain.errors import UserError
from densetrain.train import train

WORDS = "the of and to in is that for it as was with be by on not this are or from at".split()
TRAIN = ["--training.steps=2", "--schedule.warmup_steps=0", "--model.preset=tiny-llama",
         "--data.seq_len=16", "--training.global_batch_size=2", "--training.micro_batch_size=2",
         "--logging.progress=false", "--logging.plot=false", "--logging.tensorboard=false"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A prepared dataset (its tokenizer: 300 tokens) and a file where a directory belongs."""
    root = tmp_path_factory.mktemp("ws")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=120)) + f" {i}." for i in range(40)]
    (root / "raw").mkdir()
    for i, doc in enumerate(docs):
        (root / "raw" / f"d{i:03d}.txt").write_text(doc)
    tok = train_tokenizer(docs, root / "tok" / "tokenizer.json", vocab_size=300)
    prepare_dataset([str(root / "raw")], root / "ds", tokenizer=tok, cfg=PrepareConfig())
    (root / "afile").write_text("not a directory")
    return root


CASES = [
    ("missing-dataset", ['--data.datasets=["{ws}/nodir"]', "--logging.run_dir={out}"],
     ["data.datasets", "nodir", "does not exist"]),
    ("run-dir-is-file", ['--data.datasets=["{ws}/ds"]', "--logging.run_dir={ws}/afile/run"],
     ["logging.run_dir", "afile", "not a directory"]),
    ("vocab-exceeds-model", ['--data.datasets=["{ws}/ds"]', "--model.vocab_size=256",
                             "--logging.run_dir={out}"], ["model.vocab_size=256", "300"]),
]


@pytest.mark.parametrize(("overrides", "words"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_train_from_python_refuses_bad_inputs_as_the_cli_does(ws, tmp_path, capsys, overrides,
                                                             words):
    words_of_job = [o.format(ws=ws, out=tmp_path / "out") for o in overrides] + TRAIN
    job = load_job_config(None, words_of_job)
    with pytest.raises(UserError) as refused:
        train(job)
    message = str(refused.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    assert not list((tmp_path / "out").glob("*"))  # refused before any work: nothing written

    assert main(["train", *words_of_job]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"densetrain train: error: {message}"  # the CLI's one line, the same
