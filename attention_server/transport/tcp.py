"""Frames over TCP: the data plane across hosts. Blocking sockets on the sending thread."""
from __future__ import annotations

import socket
import ssl

import torch

from attention_server.partition import ShardSlice
from attention_server.transport.base import (
    TIMED_OUT, Answer, Cause, ExpertWorkerError, OrderedChannel, kernel_deadlines,
)  # fmt: skip
from protos import codec, frames
from protos.frames import FrameError, Header, Kind
from protos.security import Security
from protos.streams import recv_into_exactly


class TcpChannel(OrderedChannel):
    plane = "tcp"

    def __init__(self, worker: int, endpoint: str, timeout_s: float, port: int, security: Security):
        super().__init__(worker, endpoint, timeout_s)
        self.address = (endpoint.rpartition(":")[0], port)
        self.security = security
        self.sent: dict[int, int] = {}  # request -> slot
        self.buffers: dict[int, frames.ReceiveBuffer] = {}  # per slot, so a reply outlives the others

    def connect(self) -> socket.socket:
        """Connected, through TLS (with --tls-dir), and greeted: the worker took our HELLO."""
        where = f"tcp {self.address[0]}:{self.address[1]}"
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as err:
            raise self.error(Cause.UNAVAILABLE, f"{where}: {err}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self.security.wrap_client(sock, self.address[0])
            hello, token = frames.hello_frame(self.security.hello_token())
            frames.send_frame(sock, hello, [token])
            header = frames.recv_header(sock)  # TLS 1.3: a refused client certificate shows here
            reason = bytearray(header.payload if header is not None else 0)
            if header is not None and header.payload and not recv_into_exactly(sock, memoryview(reason)):
                header = None
        except ssl.SSLError as err:
            sock.close()
            raise self.error(Cause.UNAUTHENTICATED, f"{where}: TLS: {err}") from None
        except (OSError, FrameError, codec.CodecError) as err:
            sock.close()
            raise self.error(Cause.UNAVAILABLE, f"{where}: HELLO: {err}") from None
        sock = self.greeted(sock, where, header, reason)
        kernel_deadlines(sock, self.timeout_s, self.deadline_s)
        return sock

    def send(self, layer: int, slot: int, x: torch.Tensor, part: ShardSlice) -> int:
        sock, request = self.connected(), self.next_request()
        header = frames.forward_header(request, layer, slot, len(part.rows), x.shape[1], x.dtype, part.num_pairs)
        try:
            frames.send_frame(sock, header, frames.forward_parts(x, part.rows, part.pairs))
        except TIMED_OUT:
            raise self.lost(f"send: the worker took nothing for {self.timeout_s:g} s", Cause.DEADLINE) from None
        except OSError as err:
            raise self.lost(f"send: {err}") from None
        self.sent[request] = slot
        return request

    def send_echo(self, payload: memoryview) -> int:
        """A transport probe: the worker sends `payload` back unchanged."""
        sock, request = self.connected(), self.next_request()
        try:
            frames.send_frame(sock, Header(Kind.ECHO, request, payload=len(payload)), [payload])
        except OSError as err:
            raise self.lost(f"send: {err}") from None
        self.sent[request] = 0
        return request

    def read_reply(self) -> tuple[int, Answer | ExpertWorkerError]:
        header, payload = self._read()
        return header.request, self._result(header, payload)

    def _read(self) -> tuple[Header, memoryview]:
        sock = self.sock
        if sock is None:
            raise self.error(Cause.UNAVAILABLE, "connection closed")
        try:
            header = frames.recv_header(sock)
            if header is None:
                raise self.lost("the worker closed the connection")
            buffer = self.buffers.setdefault(self.sent.pop(header.request, 0), frames.ReceiveBuffer())
            payload = buffer.view(header.payload)
            if header.payload and not recv_into_exactly(sock, payload):
                raise self.lost("the worker closed the connection mid-frame")
        except (OSError, FrameError, codec.CodecError) as err:
            raise self.receive_failed(err) from None
        return header, payload

    def _result(self, header: Header, payload: memoryview) -> Answer | ExpertWorkerError:
        if header.kind == Kind.PARTIAL:
            return Answer(frames.read_partial(header, payload), header.compute_ns)
        if header.kind == Kind.ECHO:
            return Answer(frames.read_bytes(payload))
        if header.kind == Kind.ERROR:
            reason = bytes(payload).decode(errors="replace")
            if header.request == 0:  # the worker could not read our framing and closed the stream
                raise self.lost(reason, Cause.REFUSED, frames.status_name(header.status))
            return self.error(Cause.REFUSED, reason, frames.status_name(header.status))
        raise self.lost(f"unexpected {header.kind.name} frame", Cause.REFUSED)

    def close(self) -> None:
        self.sent.clear()
        super().close()
