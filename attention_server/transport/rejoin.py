"""Watch the expert workers that are down and put them back once they serve the same shards again.

One daemon thread per process, started the first time a worker goes down. Every `interval_s` it
asks each down worker's standard health service (grpc.health.v1); a worker that answers SERVING
is handshaken again (its Info compared with the placement, as at start-up) and, when it matches,
gets a fresh channel (a restarted worker's data plane has a new address or port) and is put back
into the transport, after the transport's prepare_rejoin (re-placement's extra experts). A worker
that comes back holding something else stays out, and the log says why, once per reason.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attention_server.handshake import WorkerMismatchError, fetch_info
from attention_server.transport.base import Channel, ExpertTransport, ExpertWorkerError
from protos import expert_pb2 as pb
from protos.security import Security

logger = logging.getLogger(__name__)


class Rejoiner:
    def __init__(
        self,
        endpoints: tuple[str, ...],
        differences: Callable[[int, pb.InfoResponse], list[str]],
        open_channel: Callable[[int, pb.InfoResponse], Channel],
        security: Security,
        interval_s: float = 0.5,
        timeout_s: float = 2.0,
    ):
        self.endpoints = endpoints
        self.differences = differences  # what a worker's Info lacks to serve its shards, [] when it matches
        self.open_channel = open_channel
        self.security = security
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.transport: ExpertTransport | None = None  # set once the transport exists
        self._watching: set[int] = set()
        self._refusals: dict[int, str] = {}  # the last reason logged per worker
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, worker: int) -> None:
        """ExpertTransport's on_down: watch `worker` until it is back."""
        with self._lock:
            self._watching.add(worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hetero-moe-rejoin", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        assert self.transport is not None
        while not self.transport.closed:
            time.sleep(self.interval_s)
            with self._lock:
                watching = sorted(self._watching)
            for worker in watching:
                if self._try(worker):
                    with self._lock:
                        self._watching.discard(worker)

    def _try(self, worker: int) -> bool:
        endpoint = self.endpoints[worker]
        with self.security.channel(endpoint) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
            except grpc.RpcError:
                return False
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        try:
            info = fetch_info(worker, endpoint, self.timeout_s, self.security)
        except WorkerMismatchError:
            return False
        if diffs := self.differences(worker, info):
            reason = "; ".join(diffs)
            if self._refusals.get(worker) != reason:
                self._refusals[worker] = reason
                logger.error("expert worker %d at %s is serving again but stays out: %s", worker, endpoint, reason)
            return False
        assert self.transport is not None
        try:
            if self.transport.prepare_rejoin is not None:
                self.transport.prepare_rejoin(worker)
        except Exception as err:  # e.g. it could not load the current layout's experts
            logger.warning("expert worker %d at %s answers, but stays out for now: %s", worker, endpoint, err)
            return False
        try:
            fresh = self.open_channel(worker, info)
        except (ExpertWorkerError, ValueError) as err:
            logger.warning("expert worker %d at %s answers, but its data plane does not: %s", worker, endpoint, err)
            return False
        self._refusals.pop(worker, None)
        self.transport.rejoin(worker, fresh)
        return True
