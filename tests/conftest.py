"""Shared pytest setup: the `slow` marker is skipped unless --runslow or DENSETRAIN_FULL=1;
the `s3` fixture (a local moto S3 server)."""

import os
import socket

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("DENSETRAIN_FULL") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or DENSETRAIN_FULL=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on localhost, reached through the standard AWS variables; yields an
    fsspec S3 filesystem with the bucket ``ckpt`` created."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
        monkeypatch.setenv(key, value)
    import urllib.request

    import s3fs

    reset = urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset).close()  # moto keeps its buckets per process: start empty

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("ckpt")
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()
