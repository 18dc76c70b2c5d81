"""gRPC edge of the worker: decode -> validate -> compute -> encode, and status mapping."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from expert_server import metrics
from expert_server.experts import LocalExperts, RequestError
from protos import PROTOCOL_VERSION, codec
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# The one place where exceptions become gRPC statuses.
_STATUS = {RequestError: grpc.StatusCode.INVALID_ARGUMENT, codec.CodecError: grpc.StatusCode.INVALID_ARGUMENT}


def status_for(exc: Exception) -> grpc.StatusCode:
    for kind, code in _STATUS.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    def __init__(self, experts: LocalExperts, worker_index: int, num_workers: int):
        self.experts = experts
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
            expert_ranges=[pb.ExpertRange(start=experts.start, end=experts.end)],
            activation_dtype=codec.wire_dtype(ckpt.dtype),
            weight_format=experts.shard.weight_format,
            kernel_backend=experts.shard.kernel_backend,
            activation=ckpt.activation,
        )
        # One compute thread: requests run in arrival order and the event loop
        # stays free for health checks while torch works.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="experts")

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self.info

    async def Forward(self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        start = time.perf_counter()
        metrics.BYTES_RECEIVED.inc(sum(len(t.data) for t in (request.hidden, request.pair_rows,
                                                              request.pair_experts, request.pair_weights)))
        try:
            batch = self.experts.make_batch(
                request.layer,
                codec.decode(request.hidden),
                codec.decode(request.pair_rows),
                codec.decode(request.pair_experts),
                codec.decode(request.pair_weights),
            )
            partial = await asyncio.get_running_loop().run_in_executor(self._compute, self.experts.forward, batch)
        except Exception as exc:  # mapped to a status; the worker keeps serving
            code = status_for(exc)
            metrics.REQUESTS.labels(code.name).inc()
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("Forward failed on layer %d", request.layer)
            await context.abort(code, f"{type(exc).__name__}: {exc}")
        response = pb.ForwardResponse(partial=codec.encode(partial))
        metrics.BYTES_SENT.inc(len(response.partial.data))
        metrics.ROWS.inc(partial.shape[0])
        metrics.PAIRS.inc(batch.pair_rows.shape[0])
        metrics.REQUESTS.labels(grpc.StatusCode.OK.name).inc()
        metrics.FORWARD_SECONDS.observe(time.perf_counter() - start)
        return response

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)
