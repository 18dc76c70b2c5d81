"""gRPC edge of the worker: Info, Place, the unary protobuf Forward and the raw-bytes frame stream.

Every request goes through the shared `ExpertHandler` (validate -> compute -> count), and a Place
through `ExtraExperts`, whose statuses come from expert_server/status.py; this module only decodes
and encodes.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf.message import DecodeError

from expert_server import metrics
from expert_server.extras import ExtraExperts
from expert_server.status import status_for
from expert_server.transport.handler import ExpertHandler, Refused
from protos import PROTOCOL_VERSION, codec, frames
from protos import expert_pb2 as pb
from protos.frames import HEADER, Header

logger = logging.getLogger(__name__)


class ExpertServicer:
    def __init__(self, handler: ExpertHandler, extras: ExtraExperts, worker_index: int, num_workers: int,
                 expert_replicas: int, data_planes: list[pb.DataPlane]):  # fmt: skip
        self.handler, self.extras = handler, extras
        experts = handler.experts
        ckpt = experts.ckpt
        self.info = pb.InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            model_fingerprint=ckpt.fingerprint,
            model_type=ckpt.model_type,
            num_hidden_layers=ckpt.num_hidden_layers,
            moe_layers=list(ckpt.moe_layers),
            num_experts=ckpt.num_experts,
            hidden_size=ckpt.hidden_size,
            worker_index=worker_index,
            num_workers=num_workers,
            expert_ranges=[pb.ExpertRange(start=start, end=end) for start, end in experts.ranges],
            expert_replicas=expert_replicas,
            activation_dtype=codec.wire_dtype(ckpt.dtype),
            weight_format=experts.weight_format,
            kernel_backend=experts.kernel_backend,
            load_format=experts.load_format,
            group_size=experts.group_size,
            activation=ckpt.activation,
            data_planes=data_planes,
        )
        # One gRPC compute thread: requests run in arrival order and the event loop
        # stays free for health checks while torch works.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="experts", initializer=handler.enter_thread)
        # Places run one at a time in a thread of their own: loading neither waits for the compute
        # thread nor holds it up.
        self._place = ThreadPoolExecutor(max_workers=1, thread_name_prefix="place",
                                         initializer=functools.partial(handler.enter_thread, computes=False))  # fmt: skip

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        info = pb.InfoResponse()
        info.CopyFrom(self.info)
        info.placement_epoch = self.extras.epoch
        return info

    async def Place(self, request: pb.PlaceRequest, context: grpc.aio.ServicerContext) -> pb.PlaceResponse:
        try:
            response = await asyncio.get_running_loop().run_in_executor(self._place, self.extras.place, request)
        except Exception as exc:  # mapped to a status; the worker keeps serving what it held
            code = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("Place of epoch %d failed", request.epoch)
            else:
                logger.warning("Place of epoch %d refused: %s", request.epoch, exc)
            metrics.PLACES.labels(code.name).inc()
            await context.abort(code, f"{type(exc).__name__}: {exc}")
        metrics.PLACES.labels(grpc.StatusCode.OK.name).inc()
        return response

    async def Forward(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        """The unary protobuf Forward; parsed here so that a request that does not parse is an
        INVALID_ARGUMENT with the reason (gRPC's own deserializer would answer a bare UNKNOWN)."""
        try:
            try:
                request = pb.ForwardRequest.FromString(raw)
            except DecodeError as exc:
                raise self.handler.refusal(codec.CodecError(f"ForwardRequest does not parse: {exc}")) from None
            wire = (request.hidden, request.pair_rows, request.pair_experts, request.pair_weights)
            try:
                tensors = [codec.decode(t) for t in wire]
            except codec.CodecError as exc:
                raise self.handler.refusal(exc) from None
            partial, _ = await asyncio.get_running_loop().run_in_executor(
                self._compute, self.handler.forward, request.layer, *tensors, sum(len(t.data) for t in wire)
            )
        except Refused as refused:
            await context.abort(refused.code, refused.reason)
        return pb.ForwardResponse(partial=codec.encode(partial))

    async def Echo(self, request: pb.Tensor, context: grpc.aio.ServicerContext) -> pb.Tensor:
        return request

    async def forward_frames(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        """FrameStream/Forward: one reply frame per request frame, in order."""
        loop = asyncio.get_running_loop()
        async for message in requests:
            try:
                header = Header.unpack(memoryview(message)[: HEADER.size])
                if header.payload != len(message) - HEADER.size:
                    raise frames.FrameError(f"header says {header.payload} payload bytes, message has "
                                            f"{len(message) - HEADER.size}")  # fmt: skip
            except (frames.FrameError, codec.CodecError) as err:
                reply = self.handler.refuse_stream(err)
            else:
                if header.kind == frames.Kind.ECHO:  # a transport probe: nothing to compute, no copy
                    yield message
                    continue
                payload = bytearray(memoryview(message)[HEADER.size :])  # tensors need a writable buffer
                reply = await loop.run_in_executor(self._compute, self.handler.handle, header, payload)
            yield b"".join([reply.header.pack(), reply.payload_bytes()])  # one copy of the payload

    def rpc_handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        """ExpertService as the .proto declares it (Forward's request parsed by Forward itself), and
        the frame stream, whose messages are raw bytes."""
        service = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name
        expert_service = {
            "Info": grpc.unary_unary_rpc_method_handler(
                self.Info, request_deserializer=pb.InfoRequest.FromString,
                response_serializer=pb.InfoResponse.SerializeToString),
            "Forward": grpc.unary_unary_rpc_method_handler(
                self.Forward, response_serializer=pb.ForwardResponse.SerializeToString),
            "Echo": grpc.unary_unary_rpc_method_handler(
                self.Echo, request_deserializer=pb.Tensor.FromString, response_serializer=pb.Tensor.SerializeToString),
            "Place": grpc.unary_unary_rpc_method_handler(
                self.Place, request_deserializer=pb.PlaceRequest.FromString,
                response_serializer=pb.PlaceResponse.SerializeToString),
        }  # fmt: skip
        frame_stream = {"Forward": grpc.stream_stream_rpc_method_handler(self.forward_frames)}
        return (grpc.method_handlers_generic_handler(service, expert_service),
                grpc.method_handlers_generic_handler(frames.GRPC_SERVICE, frame_stream))  # fmt: skip

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._place.shutdown(wait=False, cancel_futures=True)
