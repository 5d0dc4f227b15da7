"""Checkpoints on an S3-compatible object store against the same checkpoint on local disk.

A local S3 server (moto's ``ThreadedMotoServer`` on 127.0.0.1, as the ``s3`` fixture of
tests/conftest.py starts it) is run in a child process, so that the server's Python work does
not hold this process's GIL; it is reached through the standard AWS variables
(``AWS_ENDPOINT_URL`` ...), as a training job reaches a real store. It measures the client path
(DCP's fsspec writer and reader, s3fs, botocore) and the server's speed on this machine, not a
network.

The checkpoint is one densetrain `Transformer` (``--dim``, ``--layers``, ``--vocab``) with its
AdamW state (weights and two moments, fp32), driven through the code the trainer uses:
`AsyncCheckpointer` (train/callbacks.py `CheckpointCallback` opens one on ``checkpoint.dir``)
for saves and `load_checkpoint` for loads. Calling them directly rather than timing a
``densetrain train`` run keeps the model's forward/backward and the data pipeline out of the
figures, and the same state is written to both places. Per round, interleaved
(disk, s3, raw, ...):

1. save: a synchronous save (`async_save=False`: shards, config, manifest with the SHA-256 of
   every object read back), and load: `load_checkpoint(verify=False)`, then verify
   (`verify_checkpoint`, the check a resume runs first); MB/s = checkpoint bytes / seconds;
   on S3 the load also runs through DCP's own ``FsspecReader`` beside densetrain's reader, and
   the bytes s3fs fetches for each are counted (as a multiple of the checkpoint's size); and
   the step after DCP's write (config, manifest) is timed from the digests taken as the bytes
   were sent (what a save does) and from the objects read back and hashed;
2. raw: the same number of bytes as one object, s3fs ``pipe_file``/``cat_file`` and boto3
   ``put_object``/``get_object`` (the ceiling of this client and server);
3. async stall: `AsyncCheckpointer(async_save=True).save` (the time the training loop is
   blocked: staging to CPU memory, plus on S3 the manifest check and removal of a partial
   prefix), with the background time until the save is sealed beside it.

Usage: ``python benchmarks/bench_objstore.py [--rounds 3] [--dim 384 --layers 6]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from densetrain.checkpoint import (
    ModelState,
    TrainerCounters,
    load_checkpoint,
    objstore,
    verify_checkpoint,
)
from densetrain.checkpoint.async_save import AsyncCheckpointer
from densetrain.models.config import ModelConfig
from densetrain.models.transformer import Transformer
from densetrain.optim.interface import StandardOptimizer

_SERVER = """
import sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the parent closes stdin
server.stop()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset",
                                                  method="POST")).close()
    return proc, endpoint


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": ModelState(model), "optim": StandardOptimizer(model, optimizer),
            "trainer": TrainerCounters(step=step)}


def _size(fs, path: str) -> int:
    fs.invalidate_cache()
    return sum(int(e["size"]) for e in fs.ls(path, detail=True) if e["type"] == "file")


def _clear(where: str, fs) -> None:
    if where.startswith("s3://"):
        fs.invalidate_cache()
        if fs.exists(where[5:]):
            fs.rm(where[5:], recursive=True)
    else:
        shutil.rmtree(where, ignore_errors=True)


_FETCHED = [0]
"""Bytes s3fs has fetched for reads in this process (`_count_fetches`)."""


def _count_fetches() -> None:
    """Count every byte s3fs fetches for a file read (its range fetches, any cache)."""
    import s3fs.core

    real = s3fs.core.S3File._fetch_range

    def fetch(self, start: int, end: int) -> bytes:
        data = real(self, start, end)
        _FETCHED[0] += len(data)
        return data

    s3fs.core.S3File._fetch_range = fetch


def _checkpoint_round(where: str, fs, model, optimizer, step: int) -> dict:
    """Sync save, load, verify, then an async save's stall and background time."""
    _clear(where, fs)
    out = {}
    writer = AsyncCheckpointer(where, config_toml="x = 1\n", keep_last=0, async_save=False)
    began = time.perf_counter()
    writer.save(step, _state(model, optimizer, step))
    out["save_s"] = time.perf_counter() - began
    path = writer.wait()
    writer.close()
    if where.startswith("s3://"):
        out["bytes"] = _size(fs, str(path)[5:])
    else:
        out["bytes"] = sum(f.stat().st_size for f in Path(path).iterdir())
    if where.startswith("s3://"):
        # The manifest from the digests taken as the bytes were sent (what a save does) against
        # hashing the stored objects read back, side by side on the same shards.
        for key, hashed_as_sent in (("seal_sent", True), ("seal_readback", False)):
            _clear(where, fs)
            final, _ = objstore.begin(where, step)
            storage = objstore.writer(final)
            dcp.save(_state(model, optimizer, step), storage_writer=storage, no_dist=True)
            began = time.perf_counter()
            objstore.seal(where, final, step, config_toml="x = 1\n", keep_last=0,
                          written=storage.written() if hashed_as_sent else None)
            out[f"{key}_s"] = time.perf_counter() - began
    fetched = _FETCHED[0]
    began = time.perf_counter()
    load_checkpoint(path, _state(model, optimizer, 0), verify=False)
    out["load_s"] = time.perf_counter() - began
    if where.startswith("s3://"):
        # The same load through DCP's own fsspec reader, side by side: plan order through
        # s3fs's default read-ahead cache (what densetrain's reader replaces).
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        out["load_fetched_x"] = (_FETCHED[0] - fetched) / out["bytes"]
        fetched = _FETCHED[0]
        began = time.perf_counter()
        dcp.load(_state(model, optimizer, 0), storage_reader=FsspecReader(str(path)),
                 no_dist=True)
        out["dcp_load_s"] = time.perf_counter() - began
        out["dcp_load_fetched_x"] = (_FETCHED[0] - fetched) / out["bytes"]
    began = time.perf_counter()
    assert verify_checkpoint(path) == []
    out["verify_s"] = time.perf_counter() - began
    _clear(where, fs)
    writer = AsyncCheckpointer(where, config_toml="x = 1\n", keep_last=0, async_save=True)
    writer.save(step + 1, _state(model, optimizer, step + 1))
    began = time.perf_counter()
    writer.wait()
    out["background_s"] = time.perf_counter() - began
    writer.close()
    out["stall_s"] = writer.stall_seconds[-1]
    _clear(where, fs)
    return out


def _raw_round(fs, nbytes: int) -> dict:
    import boto3

    data = os.urandom(nbytes)
    out = {}
    began = time.perf_counter()
    fs.pipe_file("bench/raw/s3fs.bin", data)
    out["s3fs_put_s"] = time.perf_counter() - began
    fs.invalidate_cache()
    began = time.perf_counter()
    back = fs.cat_file("bench/raw/s3fs.bin")
    out["s3fs_get_s"] = time.perf_counter() - began
    assert len(back) == nbytes
    del back
    client = boto3.client("s3")
    began = time.perf_counter()
    client.put_object(Bucket="bench", Key="raw/boto3.bin", Body=data)
    out["boto3_put_s"] = time.perf_counter() - began
    began = time.perf_counter()
    back = client.get_object(Bucket="bench", Key="raw/boto3.bin")["Body"].read()
    out["boto3_get_s"] = time.perf_counter() - began
    assert len(back) == nbytes
    fs.rm("bench/raw", recursive=True)
    return out


def main() -> None:
    """Run the benchmark and print a Markdown summary."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                                    num_heads=max(1, args.dim // 64), max_seq_len=256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, args.vocab, (1, 16))).float().sum().backward()
    optimizer.step()  # the moments exist: three fp32 copies of every parameter
    params = sum(p.numel() for p in model.parameters())

    proc, endpoint = _start_server()
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        _count_fetches()
        rows: dict[str, list[dict]] = {"disk": [], "s3": [], "raw": []}
        with tempfile.TemporaryDirectory() as tmp:
            for index in range(args.rounds):
                step = 10 * (index + 1)
                rows["disk"].append(_checkpoint_round(str(Path(tmp) / "ckpt"), fs, model,
                                                      optimizer, step))
                rows["s3"].append(_checkpoint_round("s3://bench/ckpt", fs, model, optimizer,
                                                    step))
                rows["raw"].append(_raw_round(fs, rows["disk"][-1]["bytes"]))
                print(f"round {index + 1}: " + "; ".join(
                    f"{k}: " + ", ".join(f"{n} {v:.2f}" for n, v in rows[k][-1].items()
                                         if n != "bytes") for k in rows), flush=True)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[kind])

    nbytes = rows["disk"][0]["bytes"]
    mb = nbytes / 1e6
    print(f"\nparams {params / 1e6:.1f}M, checkpoint {mb:.0f} MB ({nbytes / 2**20:.0f} MiB) "
          f"model + AdamW, {args.rounds} rounds interleaved, medians; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, server {endpoint}")
    print("\n| what | disk s | disk MB/s | S3 s | S3 MB/s | S3 / disk (time) |")
    print("|---|---|---|---|---|---|")
    for key, name in (("save_s", "save (sync: shards, config, manifest)"),
                      ("load_s", "load (verify=False)"), ("verify_s", "verify (SHA-256)"),
                      ("background_s", "async save, background until sealed")):
        d, s = med("disk", key), med("s3", key)
        print(f"| {name} | {d:.2f} | {mb / d:.0f} | {s:.2f} | {mb / s:.0f} | {s / d:.2f}x |")
    d, s = med("disk", "stall_s"), med("s3", "stall_s")
    print(f"| async save stall (loop blocked) | {d:.3f} | - | {s:.3f} | - | {s / d:.2f}x |")
    print("\n| raw client, one object | put s | put MB/s | get s | get MB/s |")
    print("|---|---|---|---|---|")
    for lib in ("s3fs", "boto3"):
        put, get = med("raw", f"{lib}_put_s"), med("raw", f"{lib}_get_s")
        print(f"| {lib} | {put:.2f} | {mb / put:.0f} | {get:.2f} | {mb / get:.0f} |")
    print(f"\nS3 load, side by side: densetrain's reader {med('s3', 'load_s'):.2f} s, fetched "
          f"{med('s3', 'load_fetched_x'):.2f}x the checkpoint; DCP's FsspecReader "
          f"{med('s3', 'dcp_load_s'):.2f} s, {med('s3', 'dcp_load_fetched_x'):.2f}x "
          f"(speed-up {med('s3', 'dcp_load_s') / med('s3', 'load_s'):.2f}x)")
    print(f"S3 save, after the shards: manifest from the digests taken as the bytes were sent "
          f"{med('s3', 'seal_sent_s'):.2f} s, from the objects read back and hashed "
          f"{med('s3', 'seal_readback_s'):.2f} s")
    stalls = {k: [round(r["stall_s"], 3) for r in rows[k]] for k in ("disk", "s3")}
    ratio = med("s3", "stall_s") / med("disk", "stall_s")
    per_round = statistics.median(s["stall_s"] / d["stall_s"]
                                  for d, s in zip(rows["disk"], rows["s3"], strict=True))
    print(f"\nstalls per round: {stalls}; target S3 stall <= 2x disk: "
          f"{'met' if ratio <= 2 else 'NOT met'} (ratio of medians {ratio:.2f}x, median of "
          f"per-round ratios {per_round:.2f}x)")


if __name__ == "__main__":
    main()
