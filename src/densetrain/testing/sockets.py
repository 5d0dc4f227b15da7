"""Socket helpers for tests that put a small proxy between a client and a local server."""

from __future__ import annotations

import socket


def shut(sock: socket.socket | None) -> None:
    """Shut ``sock`` down both ways, ignoring a socket already closed."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either side closes, then shut both down (run it in a
    thread per direction)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        shut(src)
        shut(dst)
