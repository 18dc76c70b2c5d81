"""Whole buffers over a stream socket: what the TCP frames (protos/frames.py) and the raw-TCP floor of
`make bench-transport` (benchmarks/tcp_echo.py) both send and receive with. The standard library alone, so
that the floor's echo servers start without importing torch."""
from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Buffers back to back, in one sendmsg where the kernel takes them all, else in pieces."""
    buffers = [memoryview(p).cast("B") for p in parts if len(p)]
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS; one record, whose encryption copies anyway
        sock.sendall(b"".join(buffers))
        return
    sent = sock.sendmsg(buffers)
    for buffer in buffers:
        size = buffer.nbytes
        if sent >= size:
            sent -= size
            continue
        sock.sendall(buffer[sent:])
        sent = 0


def recv_into_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before the first byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionResetError(f"stream ended {got} bytes into a {len(view)}-byte read")
        got += n
    return True
