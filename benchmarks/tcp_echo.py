"""The raw-TCP floor for `make bench-transport`: length-prefixed echo over blocking sockets.

    python -m benchmarks.tcp_echo --port P

Each message is an 8-byte little-endian length and that many bytes; the server sends it back.
No framing checks, no tensors: what a round trip costs with nothing but the socket.
"""
from __future__ import annotations

import argparse
import socket
import struct
import threading

from protos.streams import recv_into_exactly, send_parts

LENGTH = struct.Struct("<Q")


def serve(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head, buffer = bytearray(LENGTH.size), bytearray(1 << 20)
    with conn:
        while recv_into_exactly(conn, memoryview(head)):
            (n,) = LENGTH.unpack(head)
            if len(buffer) < n:
                buffer = bytearray(n)
            if not recv_into_exactly(conn, memoryview(buffer)[:n]):
                return
            send_parts(conn, [head, memoryview(buffer)[:n]])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tcp_echo", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    listener = socket.create_server((a.host, a.port))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
