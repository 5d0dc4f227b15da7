"""Faults of checkpoints on a real local S3 server (moto's standalone server, the ``s3``
fixture), reached through a small HTTP proxy on real sockets: a training process killed with
SIGKILL while its background (``async_save``) upload of a checkpoint is in flight resumes from
the last complete checkpoint with the losses of an undisturbed run; throttling (HTTP 503
SlowDown) is survived and every retried request counted in the goodput ledger, including the
calls s3fs re-issues after botocore gave up."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import faultkit
import pytest

from densetrain.testing.sockets import pipe, shut

_MISSING = [m for m in ("s3fs", "moto") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (pip install -e '.[dev]')")

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message>"
             b"<RequestId>proxy</RequestId></Error>")


class _S3Proxy:
    """An HTTP/1.1 proxy to the S3 server on real sockets that reads every request line of
    every connection (requests are sent one at a time, never pipelined): the first ``fail``
    requests whose method is in ``methods`` are answered ``503 SlowDown`` (as S3 throttles) and
    their connection closed; a request whose line matches ``hold`` is never forwarded (an
    upload that hangs) until `close`; everything else is passed through unchanged."""

    def __init__(self, upstream: tuple[str, int], *, fail: int = 0,
                 methods: tuple[bytes, ...] = (b"PUT",), hold: str | None = None) -> None:
        self.upstream, self.left, self.methods = upstream, fail, methods
        self.hold = re.compile(hold.encode()) if hold else None
        self.throttled: list[bytes] = []
        self.held: list[bytes] = []
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
            self._requests(client, upstream)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                shut(sock)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = client.recv(65536)
                if not data:
                    return
                buffer += data
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            line, *fields = head.split(b"\r\n")
            headers = {k.strip().lower(): v.strip().lower()
                       for k, _, v in (f.partition(b":") for f in fields)}
            if self.hold is not None and self.hold.search(line):
                self.held.append(line)
                self.closing.wait()  # the client waits for an answer that never comes
                return
            with self.lock:
                throttle = self.left > 0 and line.split(b" ", 1)[0] in self.methods
                if throttle:
                    self.left -= 1
                    self.throttled.append(line)
            if throttle:
                if headers.get(b"expect") != b"100-continue":  # else no body comes first
                    _body(client, headers, buffer, None)
                client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                               % (len(_SLOWDOWN), _SLOWDOWN))
                return
            upstream.sendall(head + b"\r\n\r\n")
            buffer = _body(client, headers, buffer, upstream)

    def close(self) -> None:
        self.closing.set()
        self.server.close()


def _body(client: socket.socket, headers: dict, buffer: bytes,
          upstream: socket.socket | None) -> bytes:
    """Read one request body (Content-Length or chunked) from ``client`` after ``buffer``,
    sending it to ``upstream`` (when given); returns what was read past it."""

    def more() -> bytes:
        data = client.recv(65536)
        if not data:
            raise OSError("client closed mid-body")
        return data

    if headers.get(b"transfer-encoding") == b"chunked":
        sent = b""
        while True:
            while b"\r\n" not in buffer:
                buffer += more()
            size_line, rest = buffer.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            need = size + 2 if size else 0
            while len(rest) < need:
                rest += more()
            if size == 0:  # the last chunk, then trailers up to an empty line
                while not (rest.startswith(b"\r\n") or b"\r\n\r\n" in rest):
                    rest += more()
                end = 2 if rest.startswith(b"\r\n") else rest.index(b"\r\n\r\n") + 4
                sent += size_line + b"\r\n" + rest[:end]
                if upstream is not None:
                    upstream.sendall(sent)
                return rest[end:]
            sent += size_line + b"\r\n" + rest[:need]
            buffer = rest[need:]
    length = int(headers.get(b"content-length", b"0"))
    while len(buffer) < length:
        buffer += more()
    if upstream is not None:
        upstream.sendall(buffer[:length])
    return buffer[length:]


@pytest.fixture
def endpoint(s3) -> tuple[str, int]:
    """The moto server's (host, port) behind the AWS variables of the ``s3`` fixture."""
    server = urlsplit(os.environ["AWS_ENDPOINT_URL"])
    return server.hostname, server.port


def _through(monkeypatch, url: str) -> None:
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    s3fs.S3FileSystem.clear_instance_cache()


def test_throttling_503_slowdown_is_survived_and_every_retry_counted(
        fault_cache, endpoint, monkeypatch, tmp_path) -> None:
    """Seven checkpoint uploads answered ``503 SlowDown``: botocore retries each (two attempts
    here, AWS_MAX_ATTEMPTS=2), s3fs re-issues the call when botocore gives up; the save and the
    run finish, and the ledger counts one retry per refused request."""
    from densetrain.checkpoint import list_checkpoints
    from densetrain.train import train
    from densetrain.train.goodput import read_ledger

    throttled = 7
    proxy = _S3Proxy(endpoint, fail=throttled, methods=(b"PUT",))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore gives up sooner: s3fs retries too
    _through(monkeypatch, proxy.url)
    try:
        job = faultkit.job(fault_cache, tmp_path / "run", "--training.steps=3",
                           "--checkpoint.interval=3", "--checkpoint.dir=s3://ckpt/run")
        summary = train(job)
    finally:
        proxy.close()
        _through(monkeypatch, "http://{}:{}".format(*endpoint))
    assert len(proxy.throttled) == throttled
    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [3]
    assert summary["goodput_storage_retries"] >= throttled
    ledger = read_ledger(tmp_path / "run")
    assert sum(e.get("storage_retries", 0) for e in ledger) == summary["goodput_storage_retries"]


@pytest.mark.slow
def test_kill_9_during_an_async_save_to_s3_resumes_from_the_last_complete(
        fault_cache, endpoint, monkeypatch, tmp_path, s3) -> None:
    """The step-4 background upload hangs (its ``.metadata`` never reaches the server) while
    its shard is in the bucket without a manifest; the process group is killed -9 then. The
    resumed process names step 4 partial, resumes from step 2, and ends with the losses of an
    undisturbed run."""
    straight = faultkit.cli(faultkit.overrides(fault_cache, tmp_path / "straight"))
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err

    run_dir = tmp_path / "run"
    args = faultkit.overrides(fault_cache, run_dir, "--checkpoint.dir=s3://ckpt/run",
                              "--checkpoint.async_save=true")
    proxy = _S3Proxy(endpoint, hold=r"^PUT /ckpt/run/step-00000004/\.metadata")
    _through(monkeypatch, proxy.url)
    child = faultkit.cli(args, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not proxy.held:  # the save of step 4 is in flight, in the background
            assert child.poll() is None, child.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s3.invalidate_cache()
        present = {p.rsplit("/", 1)[1] for p in s3.ls("ckpt/run/step-00000004")}
        assert any(n.endswith(".distcp") for n in present) and "manifest.json" not in present
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
    finally:
        proxy.close()
        _through(monkeypatch, "http://{}:{}".format(*endpoint))
    assert child.returncode == -signal.SIGKILL
    s3.invalidate_cache()
    assert "manifest.json" not in {p.rsplit("/", 1)[1] for p in s3.ls("ckpt/run/step-00000004")}

    resumed = faultkit.cli(args)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert ("checkpoint s3://ckpt/run/step-00000004 is damaged or partial "
            "(manifest.json: missing") in err
    assert "resumed from s3://ckpt/run/step-00000002" in err
    assert faultkit.curve(run_dir) == faultkit.curve(tmp_path / "straight")  # bit for bit
    from densetrain.checkpoint import list_checkpoints

    assert [s for s, _ in list_checkpoints("s3://ckpt/run")] == [2, 4, 6]
