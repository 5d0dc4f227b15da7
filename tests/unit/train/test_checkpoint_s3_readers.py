"""Checkpoints under ``s3://`` beyond a synchronous save and resume, against a real local S3
server (moto's standalone server, the ``s3`` fixture): a background (``async_save``) save and
its bit-exact resume; ``densetrain checkpoints``, ``export``, ``eval`` and ``generate`` and
``training.init_from`` given a URL, each the same as on a local copy of the checkpoint; a
damaged newest checkpoint passed over by the readers; a missing bucket one error naming it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from densetrain.checkpoint import list_checkpoints
from densetrain.cli.main import main
from densetrain.errors import UserError
from densetrain.testing.callbacks import InterruptAfter
from densetrain.testing.sockets import pipe
from densetrain.train import read_metrics, train

_MISSING = [m for m in ("s3fs", "moto") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (pip install -e '.[dev]')")

_STEPS = ["--training.steps=6", "--checkpoint.interval=2", "--eval.interval=0",
          "--eval.sample_tokens=0", "--checkpoint.keep_last=0"]


def _curve(run_dir: str) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(run_dir)]


def test_async_save_to_s3_resumes_bit_exact(make_job, s3, monkeypatch) -> None:
    started = []
    real = dcp.async_save

    def counted(*args, **kwargs):
        started.append(isinstance(kwargs.get("storage_writer"), FsspecWriter))
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "async_save", counted)
    reference = make_job(*_STEPS, "--checkpoint.async_save=false", run="straight")
    train(reference)
    job = make_job(*_STEPS, "--checkpoint.async_save=true", "--checkpoint.dir=s3://ckpt/run",
                   run="interrupted")
    with pytest.raises(KeyboardInterrupt):
        train(job, callbacks=[InterruptAfter(at=4)])
    assert started and all(started)  # written in the background, by DCP's fsspec writer
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [2, 4]
    names = {p.rsplit("/", 1)[1] for p in s3.ls("ckpt/run/step-00000004")}
    assert {".metadata", "config.toml", "manifest.json"} <= names
    resumed = train(job)
    assert resumed["resumed_from"] == "s3://ckpt/run/step-00000004"
    assert _curve(job.logging.run_dir) == _curve(reference.logging.run_dir)  # bit for bit
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [2, 4, 6]


def test_readers_take_a_url_as_a_local_copy(make_job, s3, tmp_path, capsys) -> None:
    job = make_job("--training.steps=4", "--checkpoint.interval=2", "--eval.interval=0",
                   "--eval.sample_tokens=0", "--checkpoint.keep_last=0",
                   "--checkpoint.dir=s3://ckpt/run/checkpoints", run="src")
    train(job)
    local = tmp_path / "copy"
    s3.get("ckpt/run/checkpoints/step-00000004", str(local / "step-00000004"), recursive=True)
    capsys.readouterr()

    # densetrain checkpoints: a run prefix (checkpoints/ inside) lists and verifies both
    assert main(["checkpoints", "s3://ckpt/run", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["directory"] == "s3://ckpt/run/checkpoints"
    assert listed["used"] == "step-00000004"
    assert [(c["name"], c["state"]) for c in listed["checkpoints"]] == [
        ("step-00000004", "verified"), ("step-00000002", "verified")]

    # export: the same files as exporting the local copy
    assert main(["export", "s3://ckpt/run", "--to-hf", str(tmp_path / "hf-url")]) == 0
    assert main(["export", str(local), "--to-hf", str(tmp_path / "hf-local")]) == 0
    for name in ("model.safetensors", "config.json"):
        assert ((tmp_path / "hf-url" / name).read_bytes()
                == (tmp_path / "hf-local" / name).read_bytes())

    # eval perplexity and generate: the same numbers and text
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 4)
    outputs = []
    for model in ("s3://ckpt/run/checkpoints", str(local)):
        capsys.readouterr()
        assert main(["eval", "perplexity", model, "--text", str(text), "--json"]) == 0
        ppl = json.loads(capsys.readouterr().out)
        assert main(["generate", model, "--prompt", "def ", "--max-new-tokens", "5",
                     "--json"]) == 0
        gen = json.loads(capsys.readouterr().out)
        outputs.append((ppl.get("loss"), gen["completions"]))
    assert outputs[0] == outputs[1] and outputs[0][0] is not None

    # training.init_from: the same run as from the local copy
    runs = []
    for source, run in (("s3://ckpt/run/checkpoints/step-00000004", "init-url"),
                        (str(local / "step-00000004"), "init-local")):
        init = make_job("--training.steps=3", "--checkpoint.enabled=false", "--eval.interval=0",
                        "--eval.sample_tokens=0", f"--training.init_from={source}", run=run)
        train(init)
        runs.append([r["loss"] for r in read_metrics(init.logging.run_dir)])
    assert runs[0] == runs[1]

    # the newest made partial (its manifest gone): named, and the readers use step-2
    s3.rm_file("ckpt/run/checkpoints/step-00000004/manifest.json")
    s3.invalidate_cache()
    capsys.readouterr()
    assert main(["checkpoints", "s3://ckpt/run/checkpoints"]) == 1
    out = capsys.readouterr().out
    assert "step-00000004" in out and "damaged" in out and "manifest.json: missing" in out
    assert "uses step-00000002" in out
    assert main(["export", "s3://ckpt/run", "--to-hf", str(tmp_path / "hf-2")]) == 0
    err = capsys.readouterr().err
    assert "checkpoint s3://ckpt/run/checkpoints/step-00000004 is damaged" in err
    assert main(["checkpoints", "s3://ckpt/run/checkpoints/step-00000004"]) == 1
    assert main(["eval", "perplexity", "s3://ckpt/run/checkpoints/step-00000004",
                 "--text", str(text)]) == 2
    assert "s3://ckpt/run/checkpoints/step-00000004 is damaged" in capsys.readouterr().err


def test_missing_bucket_is_one_error_naming_the_url(make_job, s3, tmp_path, capsys) -> None:
    url = "s3://no-such-bucket/run"
    for argv in (["checkpoints", url], ["export", url, "--to-hf", str(tmp_path / "o")],
                 ["eval", "perplexity", url, "--text", "x"],
                 ["generate", url, "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert url in err and "does not exist" in err, argv
        assert "Traceback" not in err
    job = make_job("--training.steps=3", "--checkpoint.enabled=false", "--eval.interval=0",
                   f"--training.init_from={url}", run="init")
    with pytest.raises(UserError, match=r"training.init_from='s3://no-such-bucket/run'.*"
                                        r"does not exist"):
        train(job)
    assert not read_metrics(job.logging.run_dir)


class _FlakyProxy:
    """A TCP proxy to the S3 server on real sockets: the first ``fail`` connections are closed
    unanswered (a dropped connection), the later ones piped through."""

    def __init__(self, upstream: tuple[str, int], fail: int) -> None:
        import socket
        import threading

        self.upstream, self.left = upstream, fail
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.left > 0:
                self.left -= 1
                self.refused += 1
                client.close()
                continue
            upstream = socket.create_connection(self.upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()


    def close(self) -> None:
        self.server.close()


def test_dropped_connections_are_retried_and_counted(make_job, s3, monkeypatch) -> None:
    import os
    from urllib.parse import urlsplit

    import s3fs

    from densetrain.train.goodput import read_ledger

    server = urlsplit(os.environ["AWS_ENDPOINT_URL"])
    proxy = _FlakyProxy((server.hostname, server.port), fail=3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        job = make_job("--training.steps=3", "--checkpoint.interval=3", "--eval.interval=0",
                       "--eval.sample_tokens=0", "--checkpoint.dir=s3://ckpt/run", run="flaky")
        summary = train(job)
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.geturl())
        s3fs.S3FileSystem.clear_instance_cache()
    assert proxy.refused == 3
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [3]
    assert summary["goodput_storage_retries"] >= 1  # botocore's retries (aiohttp may reconnect
    # within one attempt, so not one retry per dropped connection)
    lines = read_ledger(job.logging.run_dir)
    assert sum(e.get("storage_retries", 0) for e in lines) == summary["goodput_storage_retries"]
