"""Frames over one long-lived gRPC stream per worker: the plane that always works.

grpc.aio on one event-loop thread (uvloop) owned by this module, shared by every worker's
stream; frames travel as raw bytes (no protobuf copy of the payload). The model's thread hands
frames to the loop and waits on a future per request.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc
import torch
import uvloop

from attention_server.partition import ShardSlice
from attention_server.transport.base import Answer, Cause, Channel
from protos import codec, frames
from protos.frames import HEADER, FrameError, Header, Kind
from protos.security import Security

_CAUSES = {grpc.StatusCode.DEADLINE_EXCEEDED: Cause.DEADLINE, grpc.StatusCode.UNAUTHENTICATED: Cause.UNAUTHENTICATED}

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The transport's event loop, running on its own daemon thread."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = uvloop.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="hetero-moe-grpc", daemon=True).start()
        return _LOOP


class GrpcStreamChannel(Channel):
    plane = "grpc"

    def __init__(self, worker: int, endpoint: str, timeout_s: float, security: Security):
        super().__init__(worker, endpoint, timeout_s)
        self.security = security
        self.loop = event_loop()
        self.replies: dict[int, concurrent.futures.Future] = {}
        self.outbox: asyncio.Queue | None = None  # frames for the writer task; None until connected
        self.stream_task: asyncio.Task | None = None
        self.ended = False  # the one stream ended, or close(): no other is opened (see Channel)

    def _submit(self, request: int, frame: bytes) -> int:
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self.replies[request] = reply
        self.loop.call_soon_threadsafe(self._enqueue, request, frame)
        return request

    def _enqueue(self, request: int, frame: bytes) -> None:  # on the loop
        if self.ended:
            self.replies[request].set_exception(self.error(Cause.UNAVAILABLE, "the stream to the worker ended"))
            return
        if self.outbox is None:
            self.outbox = asyncio.Queue()
            self.stream_task = self.loop.create_task(self._run(self.outbox))
        self.outbox.put_nowait(frame)

    async def _run(self, outbox: asyncio.Queue) -> None:
        """One stream: write queued frames, resolve replies as they come."""
        channel = self.security.aio_channel(self.endpoint)
        call = channel.stream_stream(frames.GRPC_METHOD)()  # no (de)serializers: raw bytes

        async def write() -> None:
            while True:
                await call.write(await outbox.get())

        writer = asyncio.ensure_future(write())
        try:
            async for message in call:
                self._resolve(message)
            self._fail(Cause.UNAVAILABLE, "the worker ended the stream")
        except grpc.aio.AioRpcError as err:
            cause = _CAUSES.get(err.code(), Cause.UNAVAILABLE)
            self._fail(cause, f"{err.code().name}: {err.details()}")
        except (FrameError, codec.CodecError) as err:
            self._fail(Cause.REFUSED, f"unreadable reply: {err}")
        finally:
            self.ended = True
            writer.cancel()
            self.outbox = None
            await channel.close()

    def _resolve(self, message: bytes) -> None:  # on the loop
        header = Header.unpack(memoryview(message)[: HEADER.size])
        payload = bytearray(memoryview(message)[HEADER.size :])  # tensors need a writable buffer
        if len(payload) != header.payload:
            raise FrameError(f"header says {header.payload} payload bytes, message has {len(payload)}")
        header.check_payload()
        if header.kind == Kind.ERROR and header.request == 0:
            raise FrameError(bytes(payload).decode(errors="replace"))
        reply = self.replies.get(header.request)
        if reply is not None and not reply.done():
            reply.set_result((header, payload))

    def _fail(self, cause: Cause, details: str) -> None:  # on the loop
        for reply in list(self.replies.values()):
            if not reply.done():
                reply.set_exception(self.error(cause, details))

    def send(self, layer: int, slot: int, x: torch.Tensor, part: ShardSlice) -> int:
        request = self.next_request()
        header = frames.forward_header(request, layer, slot, len(part.rows), x.shape[1], x.dtype, part.num_pairs)
        parts = frames.forward_parts(x, part.rows, part.pairs)
        return self._submit(request, b"".join([header.pack(), *parts]))

    def send_echo(self, payload: memoryview) -> int:
        request = self.next_request()
        return self._submit(request, b"".join([Header(Kind.ECHO, request, payload=len(payload)).pack(), payload]))

    def receive(self, request: int) -> Answer:
        try:
            header, payload = self.replies[request].result(timeout=self.deadline_s)
        except concurrent.futures.TimeoutError:
            raise self.error(Cause.DEADLINE, f"no answer within {self.deadline_s:.3g} s") from None
        finally:
            self.replies.pop(request, None)
        if header.kind == Kind.PARTIAL:
            return Answer(frames.read_partial(header, payload), header.compute_ns)
        if header.kind == Kind.ECHO:
            return Answer(frames.read_bytes(payload))
        if header.kind == Kind.ERROR:
            raise self.error(Cause.REFUSED, bytes(payload).decode(errors="replace"), frames.status_name(header.status))
        raise self.error(Cause.REFUSED, f"unexpected {header.kind.name} frame")

    def close(self) -> None:
        self.ended = True
        self.loop.call_soon_threadsafe(self._fail, Cause.UNAVAILABLE, "connection closed")  # no receive waits on
        if self.stream_task is not None:
            self.loop.call_soon_threadsafe(self.stream_task.cancel)
            self.stream_task = None
