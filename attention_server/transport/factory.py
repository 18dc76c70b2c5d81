"""Pick each worker's data plane from what its Info offers and what the operator asked for.

    auto:  shared memory when the worker runs on this host (same boot id, its socket answers),
           else TCP when offered and it connects, else the gRPC frame stream
    shm | tcp | grpc:  that plane, or a refusal naming the worker that does not offer it
"""
from __future__ import annotations

import logging

from attention_server import metrics
from attention_server.config import DATA_PLANES as PLANES
from attention_server.config import AttentionConfig
from attention_server.handshake import check_workers, expected_differences
from attention_server.transport.base import Cause, Channel, ExpertTransport, ExpertWorkerError
from attention_server.transport.grpc_stream import GrpcStreamChannel
from attention_server.transport.rejoin import Rejoiner
from attention_server.transport.shm import ShmChannel
from attention_server.transport.tcp import TcpChannel
from protos import expert_pb2 as pb
from protos import frames
from protos.checkpoint import MoeCheckpoint
from protos.placement import Placement
from protos.security import Security

logger = logging.getLogger(__name__)


class PlaneUnavailable(ValueError):
    """A worker does not offer the data plane the operator asked for."""


def _offered(info: pb.InfoResponse, kind: str) -> pb.DataPlane | None:
    return next((p for p in info.data_planes if p.kind == kind), None)


def open_channel(worker: int, endpoint: str, info: pb.InfoResponse, plane: str, timeout_s: float,
                 security: Security) -> Channel:  # fmt: skip
    """A connected channel to one worker over `plane` (one of PLANES). A worker that refuses this
    node's certificate or token raises ExpertWorkerError (Cause.UNAUTHENTICATED): never a fallback."""
    assert plane in PLANES, plane
    shm, tcp = _offered(info, "shm"), _offered(info, "tcp")
    if plane in ("auto", "shm") and shm is not None and shm.host_id == frames.host_id():
        channel = ShmChannel(worker, endpoint, timeout_s, shm.address, security)
        try:
            channel.connected()
            return channel
        except ExpertWorkerError as err:  # another network namespace (a container) on this host
            if err.cause is Cause.UNAUTHENTICATED:
                raise
            if plane == "shm":
                raise PlaneUnavailable(f"worker {worker} at {endpoint}: shared memory: {err}") from None
            logger.info("worker %d at %s: no shared memory (%s); trying TCP", worker, endpoint, err)
    if plane == "shm":
        raise PlaneUnavailable(f"worker {worker} at {endpoint} offers no shared memory to this host")
    if plane in ("auto", "tcp") and tcp is not None:
        channel = TcpChannel(worker, endpoint, timeout_s, tcp.port, security)
        try:
            channel.connected()
            return channel
        except ExpertWorkerError as err:  # e.g. a firewall or an unpublished container port
            if err.cause is Cause.UNAUTHENTICATED:
                raise
            if plane == "tcp":
                raise PlaneUnavailable(f"worker {worker} at {endpoint}: TCP data plane: {err}") from None
            logger.warning("worker %d at %s: TCP data plane unreachable (%s); using the gRPC stream", worker, endpoint, err)
    if plane == "tcp":
        raise PlaneUnavailable(f"worker {worker} at {endpoint} offers no TCP data plane")
    return GrpcStreamChannel(worker, endpoint, timeout_s, security)


def connect_workers(cfg: AttentionConfig, ckpt: MoeCheckpoint) -> tuple[ExpertTransport, list[pb.InfoResponse]]:
    """The attention node's transport: a channel to every worker of `cfg`, failover to replicas,
    and a Rejoiner that puts lost workers back once they serve their shards again. Every worker's
    Info is checked here too (`python -m attention_server` did before vLLM started; a plugin turned
    on by the environment alone did not); the Infos come back with the transport."""
    security = cfg.security()
    infos, placement = check_workers(cfg.expert_endpoints, ckpt, cfg.request_timeout_s, security, cfg.expert_replicas)

    def reopen(worker: int, info: pb.InfoResponse) -> Channel:
        channel = open_channel(worker, cfg.expert_endpoints[worker], info, cfg.data_plane, cfg.request_timeout_s,
                               security)  # fmt: skip
        metrics.TRANSPORT_PLANE.labels(str(worker), channel.plane).set(1)
        return channel

    rejoiner = Rejoiner(cfg.expert_endpoints, lambda w, info: expected_differences(info, ckpt, w, placement), reopen,
                        security)  # fmt: skip
    transport = connect(cfg.expert_endpoints, infos, cfg.data_plane, cfg.request_timeout_s, placement, security,
                        cfg.worker_loss_timeout_s, rejoiner.watch)  # fmt: skip
    rejoiner.transport = transport
    for channel in transport.channels:
        metrics.TRANSPORT_PLANE.labels(str(channel.worker), channel.plane).set(1)
        metrics.WORKER_UP.labels(str(channel.worker)).set(1)
    return transport, infos


def connect(endpoints: tuple[str, ...], infos: list[pb.InfoResponse], plane: str, timeout_s: float,
            placement: Placement, security: Security, loss_timeout_s: float = 60.0, on_down=None) -> ExpertTransport:  # fmt: skip
    """An ExpertTransport over one channel per worker (see ExpertTransport for the rest)."""
    channels = [open_channel(w, e, info, plane, timeout_s, security) for w, (e, info) in enumerate(zip(endpoints, infos))]
    for channel in channels:
        logger.info("worker %d at %s: data plane %s", channel.worker, channel.endpoint, channel.plane)
    return ExpertTransport(channels, placement, loss_timeout_s, on_down)
