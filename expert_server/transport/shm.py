"""Frames through shared memory (the same-host data plane).

The client creates one memfd segment per slot (Header.slot: one per micro-batch in flight) and passes it over an abstract Unix
socket (SOCK_SEQPACKET, SCM_RIGHTS), so nothing has a name in /dev/shm or on disk: when either
side dies, even by kill -9, the kernel frees the segments and the socket. Per frame only the
header travels over the socket. A slot holds the request payload at offset 0 and the reply's at
`frames.reply_offset(request payload)`. The common FORWARD frame is answered by a loop in C
(expert_server/native.py) without Python; every other message is answered here.
"""
from __future__ import annotations

import mmap
import os
import socket
import uuid

import torch

from expert_server import metrics
from expert_server.native import Connection
from expert_server.transport.base import Plane, ReplyDelay
from expert_server.transport.handler import ExpertHandler, Reply
from protos import codec, frames
from protos import expert_pb2 as pb
from protos.frames import HEADER, FrameError, Header, Kind
from protos.security import MAX_TOKEN_BYTES, Security

class ShmPlane(Plane):
    kind = "shm"

    def __init__(self, handler: ExpertHandler, security: Security):
        self.address = f"\0hetero-moe-{uuid.uuid4().hex}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen(64)
        super().__init__(handler, listener, security)

    def advertise(self) -> pb.DataPlane:
        return pb.DataPlane(kind=self.kind, address=self.address[1:], host_id=frames.host_id())

    def serve(self, conn: socket.socket, delay: ReplyDelay) -> None:
        if not self._greet(conn):
            return
        conn.settimeout(None)
        segments: dict[int, mmap.mmap] = {}  # per slot; unmapped when dropped
        # The common frame is answered by the C loop (native.py) when a held set computes frames
        # in C; every other message comes back here, and so do its replies under a reply delay.
        tables = self.handler.experts.frames
        loop = Connection(conn.fileno(), tables, metrics.NATIVE, hand_back=bool(delay.config)) if tables else None
        try:
            while True:
                if loop is None:
                    message, fds, _, _ = socket.recv_fds(conn, HEADER.size, 1)
                    answered = False
                else:
                    message, fds, answered = loop.serve() or (b"", [], False)
                if not message:
                    return
                if answered:
                    delay.send(lambda message=message: conn.send(message), Header.unpack(message).rows)
                    continue
                try:
                    header = Header.unpack(message)
                    header.check_payload()
                except (FrameError, codec.CodecError) as err:
                    reply = self.handler.refuse_stream(err)
                else:
                    if fds:  # a new (or larger) segment for this slot's frames
                        segments[header.slot] = mmap.mmap(fds[0], 0)
                        if loop is not None:
                            loop.map(header.slot, segments[header.slot])
                    reply = self._answer(header, segments.get(header.slot))
                finally:
                    for fd in fds:
                        os.close(fd)
                message = reply.header.pack() + (bytes(reply.payload) if reply.header.kind == Kind.ERROR else b"")
                delay.send(lambda message=message: conn.send(message), reply.rows)
        finally:
            if loop is not None:
                loop.release()

    def _greet(self, conn: socket.socket) -> bool:
        """The HELLO: one message, its header and the token."""
        message = conn.recv(HEADER.size + MAX_TOKEN_BYTES)
        if not message:
            return False
        try:
            header = Header.unpack(message[: HEADER.size])
            if header.payload != len(message) - HEADER.size:
                raise FrameError(f"header says {header.payload} payload bytes, message has {len(message) - HEADER.size}")
        except (FrameError, codec.CodecError) as err:
            reply = self.handler.refuse_stream(err)
        else:
            reply = self.hello_reply(header, message[HEADER.size :])
        conn.send(reply.header.pack() + bytes(reply.payload))
        return reply.header.kind == Kind.HELLO

    def _answer(self, header: Header, segment: mmap.mmap | None) -> Reply:
        reply_at = frames.reply_offset(header.payload)
        reply_end = reply_at + frames.reply_size(header)
        if segment is None or reply_end > len(segment):
            missing = FrameError("the shared segment is missing or too small for this frame and its reply")
            return self.handler.error(header.request, self.handler.refusal(missing))
        view = memoryview(segment)
        reply = self.handler.handle(header, view[: header.payload], view[reply_at:reply_end])
        if reply.partial is not None and reply.partial.numel():
            flat = reply.partial.reshape(-1)
            torch.frombuffer(segment, dtype=torch.float32, count=flat.numel(), offset=reply_at).copy_(flat)
        elif reply.header.kind == Kind.ECHO:
            segment[reply_at : reply_at + reply.header.payload] = reply.payload
        return reply
