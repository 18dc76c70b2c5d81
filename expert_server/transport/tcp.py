"""Frames over TCP (the cross-host data plane): blocking sockets, a thread per connection."""
from __future__ import annotations

import socket

from expert_server.transport.base import Plane, ReplyDelay
from expert_server.transport.handler import ExpertHandler
from protos import codec, frames
from protos import expert_pb2 as pb
from protos.frames import FrameError


class TcpPlane(Plane):
    kind = "tcp"

    def __init__(self, handler: ExpertHandler, host: str, port: int):
        super().__init__(handler, socket.create_server((host, port), backlog=64))
        self.port = self.listener.getsockname()[1]

    def advertise(self) -> pb.DataPlane:
        return pb.DataPlane(kind=self.kind, port=self.port)

    def serve(self, conn: socket.socket, delay: ReplyDelay) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = frames.ReceiveBuffer(1 << 20)
        while True:
            try:
                frame = frames.recv_frame(conn, buffer)
            except (FrameError, codec.CodecError) as err:
                # The stream's framing is lost: say why, then close it (the client reconnects).
                reply = self.handler.refuse_stream(err)
                frames.send_frame(conn, reply.header, [reply.payload])
                return
            if frame is None:
                return
            reply = self.handler.handle(*frame)
            payload = reply.payload_bytes()
            if delay.config and reply.partial is None:
                payload = bytes(payload)  # an echo's bytes view the receive buffer, which the next frame reuses
            delay.send(lambda header=reply.header, payload=payload: frames.send_frame(conn, header, [payload]), reply.rows)
