"""python -m expert_server --model DIR --worker-index i --num-workers W --port P (--tls-dir DIR | --plaintext)
       [--expert-replicas R]

Loads shard i of every MoE layer (experts [i*E/W, (i+1)*E/W)) and, with R > 1,
the R-1 shards before it round the ring (protos/placement.py), and serves them
over gRPC (grpc.aio on uvloop), with the standard health service and reflection.
A Place RPC adds experts beside the shards while it serves (re-placement,
expert_server/extras.py), loaded with the same flags as the shards.
With --tls-dir, gRPC and the TCP data plane take only clients holding a certificate of the
cluster's CA, and every call must carry the cluster token (protos/security.py).
"""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import signal
import socket

import grpc
import torch
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expert_server import metrics
from expert_server.config import WorkerConfig
from expert_server.experts import HeldShard, LocalExperts
from expert_server.extras import ExtraExperts
from expert_server.servicer import ExpertServicer
from expert_server.transport.handler import ExpertHandler
from expert_server.transport.base import ReplyDelayConfig
from expert_server.transport.shm import ShmPlane
from expert_server.transport.tcp import TcpPlane
from expert_server.weights import free_memory_per_worker, load_experts, load_shard, loaded_expert_bytes
from protos import GRPC_OPTIONS
from protos import expert_pb2 as pb
from kernels.formats import FormatMismatch, UnsupportedQuantization
from kernels.oracle import BackendUnavailable
from protos.checkpoint import CheckpointError, read_checkpoint
from protos.placement import Placement, choose_replicas
from protos.security import Security, SecurityError

logger = logging.getLogger("expert_server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except socket.gaierror:
        return False


async def serve(cfg: WorkerConfig) -> None:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    security = Security.load(cfg.tls_dir, "worker")
    if not security.tls and not is_loopback(cfg.host):
        logger.warning("!" * 100)
        logger.warning("PLAINTEXT on %s: anyone who reaches this port can read the routed rows and send work; "
                       "use --tls-dir (python -m cluster certs DIR) beyond loopback", cfg.host)  # fmt: skip
        logger.warning("!" * 100)
    if cfg.metrics_port is not None:
        metrics.serve_metrics(cfg.host, cfg.metrics_port)
    metrics.UP.set(0)
    ckpt = read_checkpoint(cfg.model)
    device = torch.device(cfg.device)
    replicas = cfg.expert_replicas
    if replicas is None:
        replicas, reason = choose_replicas(ckpt.expert_bytes, cfg.num_workers, free_memory_per_worker(device, cfg.num_workers))
        logger.info("expert replicas: %d (auto: %s)", replicas, reason)
    placement = Placement(ckpt.num_experts, cfg.num_workers, replicas)
    shards = []
    for start, end in placement.worker_ranges(cfg.worker_index):
        loaded = load_shard(ckpt, start, end, device, cfg.weight_format, cfg.kernel_backend, cfg.group_size)
        shards.append(HeldShard(start, end, loaded))
    experts = LocalExperts(ckpt, shards, device)
    held = ", ".join(f"[{start}, {end})" for start, end in experts.ranges)
    delay = ReplyDelayConfig(cfg.bench_reply_delay_ms / 1e3, cfg.bench_reply_delay_us_per_row / 1e6)
    handler = ExpertHandler(experts, delay)
    load = functools.partial(load_experts, ckpt, device=device, weight_format=cfg.weight_format,
                             kernel_backend=cfg.kernel_backend, group_size=cfg.group_size)  # fmt: skip
    extras = ExtraExperts(experts, load, handler.hold,
                          loaded_expert_bytes(ckpt, experts.load_format, experts.group_size))  # fmt: skip
    metrics.BENCH_REPLY_DELAY.labels("fixed").set(delay.fixed_s)
    metrics.BENCH_REPLY_DELAY.labels("per_row").set(delay.per_row_s)
    if delay:
        logger.warning("benchmark mode: every shm/tcp Forward reply is held %g ms + %g us per row",
                       cfg.bench_reply_delay_ms, cfg.bench_reply_delay_us_per_row)  # fmt: skip
    planes = []
    if "tcp" in cfg.data_planes:
        planes.append(TcpPlane(handler, cfg.host, cfg.data_port, security))
    if "shm" in cfg.data_planes:
        planes.append(ShmPlane(handler, security))
    servicer = ExpertServicer(handler, extras, cfg.worker_index, cfg.num_workers, replicas,
                              [p.advertise() for p in planes])  # fmt: skip
    metrics.SHARD.info({
        "worker": str(cfg.worker_index),
        "experts": held,
        "replicas": str(replicas),
        "kernel_backend": experts.kernel_backend,
        "weight_format": experts.weight_format,
    })

    unauthenticated = metrics.REQUESTS.labels(grpc.StatusCode.UNAUTHENTICATED.name)
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=security.server_interceptors(unauthenticated.inc))
    server.add_generic_rpc_handlers(servicer.rpc_handlers())
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = security.add_port(server, f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise SystemExit(f"expert_server: cannot bind {cfg.host}:{cfg.port}")
    await server.start()
    for plane in planes:
        plane.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics.UP.set(1)
    logger.info(
        "worker %d/%d serving experts %s of %s on %s:%d (%s); data planes: gRPC%s",
        cfg.worker_index, cfg.num_workers, held, ckpt.model_type, cfg.host, port, security.describe(),
        "".join(f", {p.kind}" + (f" port {p.port}" if p.kind == "tcp" else "") for p in planes),
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("worker %d stopping", cfg.worker_index)
    metrics.UP.set(0)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    for plane in planes:
        plane.close()
    servicer.close()


def run_as_batch() -> None:
    """SCHED_BATCH for every thread of this process (imports already started some); the threads
    started later (event loop, gRPC, the planes) inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = WorkerConfig.from_args()
    if cfg.cpu_scheduling == "batch":
        run_as_batch()
    try:
        uvloop.run(serve(cfg))
    except (BackendUnavailable, UnsupportedQuantization, FormatMismatch, CheckpointError, SecurityError) as err:
        logger.error("cannot serve: %s", err)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
