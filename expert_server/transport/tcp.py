"""Frames over TCP (the cross-host data plane): blocking sockets, a thread per connection."""
from __future__ import annotations

import socket

from expert_server.transport.base import Plane, ReplyDelay
from expert_server.transport.handler import ExpertHandler
from protos import codec, frames
from protos import expert_pb2 as pb
from protos.frames import FrameError, Kind
from protos.security import MAX_TOKEN_BYTES, Security
from protos.streams import recv_into_exactly


class TcpPlane(Plane):
    kind = "tcp"

    def __init__(self, handler: ExpertHandler, host: str, port: int, security: Security):
        super().__init__(handler, socket.create_server((host, port), backlog=64), security)
        self.port = self.listener.getsockname()[1]

    def advertise(self) -> pb.DataPlane:
        return pb.DataPlane(kind=self.kind, port=self.port)

    def secure(self, conn: socket.socket) -> socket.socket:
        return self.security.wrap_server(conn)

    def serve(self, conn: socket.socket, delay: ReplyDelay) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._greet(conn):
            return
        conn.settimeout(None)
        buffer, replies = frames.ReceiveBuffer(1 << 20), frames.ReceiveBuffer(1 << 20)
        while True:
            try:
                frame = frames.recv_frame(conn, buffer)
            except (FrameError, codec.CodecError) as err:
                self._refuse_stream(conn, err)
                return
            if frame is None:
                return
            header, payload = frame
            reply = self.handler.handle(header, payload, replies.view(frames.reply_size(header))
                                        if header.kind == Kind.FORWARD else None)  # fmt: skip
            payload = reply.payload_bytes()
            if delay.config and reply.partial is None:
                payload = bytes(payload)  # it views a buffer the next frame reuses (an echo's, a partial's)
            delay.send(lambda header=reply.header, payload=payload: frames.send_frame(conn, header, [payload]), reply.rows)

    def _greet(self, conn: socket.socket) -> bool:
        """The HELLO, read with a bounded payload (no token is longer) before anything else."""
        try:
            header = frames.recv_header(conn)
            if header is None:
                return False
            if header.payload > MAX_TOKEN_BYTES:
                raise FrameError(f"a {header.kind.name} frame of {header.payload} bytes before HELLO")
            token = bytearray(header.payload)
            if header.payload and not recv_into_exactly(conn, memoryview(token)):
                return False
        except (FrameError, codec.CodecError) as err:
            self._refuse_stream(conn, err)
            return False
        reply = self.hello_reply(header, token)
        frames.send_frame(conn, reply.header, [reply.payload])
        return reply.header.kind == Kind.HELLO

    def _refuse_stream(self, conn: socket.socket, err: Exception) -> None:
        """The stream's framing is lost: say why, then close it (the client reconnects)."""
        reply = self.handler.refuse_stream(err)
        frames.send_frame(conn, reply.header, [reply.payload])
