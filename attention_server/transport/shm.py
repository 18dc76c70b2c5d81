"""Frames through shared memory: the data plane for workers on this host.

Per slot (one per micro-batch in flight, see ExpertTransport) this side creates a memfd segment and hands it to the worker over an
abstract Unix socket (SOCK_SEQPACKET, SCM_RIGHTS); only headers travel over the socket. Rows
are gathered straight into the segment and partials are read where the worker wrote them.
Nothing has a name in /dev/shm or on disk, so a kill -9 of either side leaves nothing behind.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket

import torch

from attention_server.partition import ShardSlice
from attention_server.transport.base import Answer, Cause, ExpertWorkerError, OrderedChannel, kernel_deadlines
from kernels import native_build
from protos import codec, frames
from protos.frames import HEADER, FrameError, Header, Kind
from protos.security import Security

_MAX_ERROR_BYTES = 1 << 16


class ShmChannel(OrderedChannel):
    plane = "shm"

    def __init__(self, worker: int, endpoint: str, timeout_s: float, address: str, security: Security):
        super().__init__(worker, endpoint, timeout_s)
        self.address = "\0" + address
        self.security = security
        self.segments: dict[int, mmap.mmap] = {}  # per slot
        self.addresses: dict[int, ctypes.Array] = {}  # per slot: its segment's bytes, for the C writer
        self.sent: dict[int, tuple[int, int]] = {}  # request -> (slot, reply offset)

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.address)
        except OSError as err:
            sock.close()
            raise self.error(Cause.UNAVAILABLE, f"shm socket: {err}") from None
        kernel_deadlines(sock, self.timeout_s, self.deadline_s)
        header, token = frames.hello_frame(self.security.hello_token())
        try:
            sock.send(header.pack() + token)
            answer = sock.recv(HEADER.size + _MAX_ERROR_BYTES)
            reply = Header.unpack(answer[: HEADER.size]) if answer else None
        except (OSError, FrameError, codec.CodecError) as err:
            sock.close()
            raise self.error(Cause.UNAVAILABLE, f"shm socket: HELLO: {err}") from None
        return self.greeted(sock, "shm socket", reply, answer[HEADER.size:])

    def _segment(self, slot: int, size: int) -> tuple[mmap.mmap, int | None]:
        """The slot's segment, replaced by a larger one (whose fd goes to the worker) when too small."""
        segment = self.segments.get(slot)
        if segment is not None and len(segment) >= size:
            return segment, None
        # The old segment is unmapped when the last partial viewing it is gone.
        size = max(1 << 20, 1 << (size - 1).bit_length())
        fd = os.memfd_create(f"hetero-moe-w{self.worker}-slot{slot}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        self.addresses.pop(slot, None)
        self.segments[slot] = segment = mmap.mmap(fd, size)
        self.addresses[slot] = (ctypes.c_char * size).from_buffer(segment)
        return segment, fd

    def _submit(self, header: Header, slot: int, fill) -> int:
        sock = self.connected()
        reply_at = frames.reply_offset(header.payload)
        segment, fd = self._segment(slot, reply_at + frames.reply_size(header))
        fill(memoryview(segment))
        try:
            socket.send_fds(sock, [header.pack()], [fd] if fd is not None else [])
        except OSError as err:
            raise self.lost(f"send: {err}") from None
        finally:
            if fd is not None:
                os.close(fd)
        self.sent[header.request] = (slot, reply_at)
        return header.request

    def send(self, layer: int, slot: int, x: torch.Tensor, part: ShardSlice) -> int:
        header = frames.forward_header(self.next_request(), layer, slot, part.rows.shape[0], x.shape[1], x.dtype,
                                       part.num_pairs)  # fmt: skip
        segment = self.segments.get(slot)
        reply_at = frames.reply_offset(header.payload)
        if segment is None or reply_at + frames.reply_size(header) > len(segment):  # a new segment: its fd goes along
            return self._submit(header, slot, lambda view: frames.write_forward(view, x, part.rows, part.pairs))
        # The worker maps this slot's segment already: the frame is written and announced in one C call,
        # which reads x [T, H], rows [T_s] int64 and pairs [3, P_s] int32 as they lie in memory.
        rows, pairs = part.rows.contiguous(), part.pairs.contiguous()
        assert rows.dtype == torch.int64 and pairs.dtype == torch.int32 and x.is_contiguous(), "ShardSlice's types"
        status = native_build.host_library().hm_shm_send_forward(
            self.connected().fileno(), ctypes.addressof(self.addresses[slot]), len(segment), header.request, layer,
            slot, x.data_ptr(), x.shape[0], x.shape[1] * x.element_size(), x.shape[1], header.dtype, rows.data_ptr(),
            header.rows, pairs.data_ptr(), header.pairs)  # fmt: skip
        if status == -errno.EINVAL:
            raise ValueError(f"a slice's rows lie outside the layer input's {x.shape[0]} tokens")
        if status != 0:
            raise self.lost(f"send: {os.strerror(-status)}")
        self.sent[header.request] = (slot, reply_at)
        return header.request

    def send_echo(self, payload: memoryview) -> int:
        """A transport probe: the worker copies `payload` into the reply region."""
        header = Header(Kind.ECHO, self.next_request(), payload=len(payload))
        return self._submit(header, 0, lambda view: view.__setitem__(slice(0, len(payload)), payload))

    def read_reply(self) -> tuple[int, Answer | ExpertWorkerError]:
        header, reason = self._read()
        return header.request, self._result(header, reason)

    def _read(self) -> tuple[Header, bytes]:
        if self.sock is None:
            raise self.error(Cause.UNAVAILABLE, "connection closed")
        try:
            message = self.sock.recv(HEADER.size + _MAX_ERROR_BYTES)
            if not message:
                raise self.lost("the worker closed the connection")
            return Header.unpack(message[: HEADER.size]), message[HEADER.size :]
        except (OSError, FrameError, codec.CodecError) as err:
            raise self.receive_failed(err) from None

    def _result(self, header: Header, reason: bytes) -> Answer | ExpertWorkerError:
        if header.kind == Kind.ERROR:
            text = reason.decode(errors="replace")
            if header.request == 0:
                raise self.lost(text, Cause.REFUSED, frames.status_name(header.status))
            self.sent.pop(header.request, None)
            return self.error(Cause.REFUSED, text, frames.status_name(header.status))
        slot, reply_at = self.sent.pop(header.request)
        segment = self.segments[slot]
        try:
            header.check_payload()
            if reply_at + header.payload > len(segment):
                raise FrameError(f"a {header.payload}-byte reply does not fit the {len(segment)}-byte segment")
        except (FrameError, codec.CodecError) as err:
            raise self.lost(f"unreadable reply: {err}", Cause.REFUSED) from None
        if header.kind == Kind.PARTIAL:
            return Answer(frames.read_partial(header, memoryview(segment)[reply_at : reply_at + header.payload]),
                          header.compute_ns)
        if header.kind == Kind.ECHO:
            return Answer(frames.read_bytes(memoryview(segment)[reply_at : reply_at + header.payload]))
        raise self.lost(f"unexpected {header.kind.name} frame", Cause.REFUSED)

    def close(self) -> None:
        self.addresses.clear()
        self.segments.clear()  # unmapped as their last views go
        self.sent.clear()
        super().close()
