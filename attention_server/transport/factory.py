"""Pick each worker's data plane from what its Info offers and what the operator asked for.

    auto:  shared memory when the worker runs on this host (same boot id, its socket answers),
           else TCP when offered and it connects, else the gRPC frame stream
    shm | tcp | grpc:  that plane, or a refusal naming the worker that does not offer it
"""
from __future__ import annotations

import logging

from attention_server.config import DATA_PLANES as PLANES
from attention_server.transport.base import Channel, ExpertTransport, ExpertWorkerError
from attention_server.transport.grpc_stream import GrpcStreamChannel
from attention_server.transport.shm import ShmChannel
from attention_server.transport.tcp import TcpChannel
from protos import expert_pb2 as pb
from protos import frames

logger = logging.getLogger(__name__)


class PlaneUnavailable(ValueError):
    """A worker does not offer the data plane the operator asked for."""


def _offered(info: pb.InfoResponse, kind: str) -> pb.DataPlane | None:
    return next((p for p in info.data_planes if p.kind == kind), None)


def open_channel(worker: int, endpoint: str, info: pb.InfoResponse, plane: str, timeout_s: float) -> Channel:
    """A connected channel to one worker over `plane` (one of PLANES)."""
    assert plane in PLANES, plane
    shm, tcp = _offered(info, "shm"), _offered(info, "tcp")
    if plane in ("auto", "shm") and shm is not None and shm.host_id == frames.host_id():
        channel = ShmChannel(worker, endpoint, timeout_s, shm.address)
        try:
            channel.connect()
            return channel
        except ExpertWorkerError as err:  # another network namespace (a container) on this host
            if plane == "shm":
                raise PlaneUnavailable(f"worker {worker} at {endpoint}: shared memory: {err}") from None
            logger.info("worker %d at %s: no shared memory (%s); trying TCP", worker, endpoint, err)
    if plane == "shm":
        raise PlaneUnavailable(f"worker {worker} at {endpoint} offers no shared memory to this host")
    if plane in ("auto", "tcp") and tcp is not None:
        channel = TcpChannel(worker, endpoint, timeout_s, tcp.port)
        try:
            channel.connect()
            return channel
        except ExpertWorkerError as err:  # e.g. a firewall or an unpublished container port
            if plane == "tcp":
                raise PlaneUnavailable(f"worker {worker} at {endpoint}: TCP data plane: {err}") from None
            logger.warning("worker %d at %s: TCP data plane unreachable (%s); using the gRPC stream", worker, endpoint, err)
    if plane == "tcp":
        raise PlaneUnavailable(f"worker {worker} at {endpoint} offers no TCP data plane")
    return GrpcStreamChannel(worker, endpoint, timeout_s)


def connect(endpoints: tuple[str, ...], infos: list[pb.InfoResponse], plane: str, timeout_s: float) -> ExpertTransport:
    channels = [open_channel(w, e, info, plane, timeout_s) for w, (e, info) in enumerate(zip(endpoints, infos))]
    for channel in channels:
        logger.info("worker %d at %s: data plane %s", channel.worker, channel.endpoint, channel.plane)
    return ExpertTransport(channels)
