"""Start-up check: every worker must hold the model and shard this server expects."""
from __future__ import annotations

import logging
import time

import grpc

from protos import PROTOCOL_VERSION, codec
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import MoeCheckpoint
from protos.placement import Placement
from protos.security import Security

logger = logging.getLogger(__name__)


class WorkerMismatchError(RuntimeError):
    """A worker is unreachable or holds something other than what the placement needs."""


def expected_differences(info: pb.InfoResponse, ckpt: MoeCheckpoint, worker: int, placement: Placement) -> list[str]:
    """Human-readable differences between a worker's Info and what worker `worker` must hold."""
    held = [(r.start, r.end) for r in info.expert_ranges]
    checks = [
        ("protocol version", info.protocol_version, PROTOCOL_VERSION),
        ("model fingerprint", info.model_fingerprint, ckpt.fingerprint),
        ("model type", info.model_type, ckpt.model_type),
        ("MoE layers", list(info.moe_layers), list(ckpt.moe_layers)),
        ("number of experts", info.num_experts, ckpt.num_experts),
        ("hidden size", info.hidden_size, ckpt.hidden_size),
        ("worker index", info.worker_index, worker),
        ("number of workers", info.num_workers, placement.num_workers),
        ("expert replicas", info.expert_replicas, placement.replicas),
        ("expert ranges", held, placement.worker_ranges(worker)),
        ("activation", info.activation, ckpt.activation),
    ]
    diffs = [f"{what}: worker has {got}, expected {want}" for what, got, want in checks if got != want]
    if info.activation_dtype != codec.wire_dtype(ckpt.dtype):
        diffs.append(f"activation dtype: worker has {pb.DType.Name(info.activation_dtype)}, expected {ckpt.dtype}")
    return diffs


RETRY_INTERVAL_S = 0.5


def fetch_info(worker: int, endpoint: str, ready_timeout_s: float, security: Security) -> pb.InfoResponse:
    """The worker's Info, once it answers; WorkerMismatchError when it does not in time (naming the
    last connection error: a refused certificate reads as a closed socket or a failed handshake)
    or refuses this node's token."""
    deadline = time.monotonic() + ready_timeout_s
    last = "no attempt"
    with security.channel(endpoint) as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        while (left := deadline - time.monotonic()) > 0:
            try:
                return stub.Info(pb.InfoRequest(), timeout=left)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:  # it answered: no point in waiting
                    raise WorkerMismatchError(f"worker {worker} at {endpoint}: Info failed: {err.code().name}: "
                                              f"{err.details()}") from None  # fmt: skip
                last = err.details()
            time.sleep(min(RETRY_INTERVAL_S, max(0.0, deadline - time.monotonic())))
    raise WorkerMismatchError(f"worker {worker} at {endpoint}: not reachable within {ready_timeout_s:.0f} s "
                              f"(last error: {last}); {_unreachable_hint(last, security)}")  # fmt: skip


def _unreachable_hint(last_error: str, security: Security) -> str:
    """What most likely kept a worker from answering, from gRPC's last connection error."""
    if "Connection refused" in last_error:
        return "nothing accepts connections there: is the worker running, and is that its --port?"
    if security.tls:
        return f"with {security.describe()}, the worker must hold certificates from the same CA"
    return "a worker that takes mutual TLS closes plaintext connections: give this node the cluster's --tls-dir"


def check_workers(
    endpoints: tuple[str, ...], ckpt: MoeCheckpoint, ready_timeout_s: float, security: Security,
    replicas: int | None = None,
) -> tuple[list[pb.InfoResponse], Placement]:
    """Wait for each worker, then compare its Info with the placement of `replicas` (None: the
    first worker's); raise WorkerMismatchError naming every difference. Every expert is then held by
    exactly R of the workers."""
    infos, problems, placement = [], [], None
    for worker, endpoint in enumerate(endpoints):
        try:
            info = fetch_info(worker, endpoint, ready_timeout_s, security)
        except WorkerMismatchError as err:
            problems.append(str(err))
            continue
        if placement is None:
            try:
                # A worker of another protocol reports no replicas; its version is named below.
                placement = Placement(ckpt.num_experts, len(endpoints), replicas or info.expert_replicas or 1)
            except ValueError as err:
                raise WorkerMismatchError(f"worker {worker} at {endpoint}: {err}") from None
        diffs = expected_differences(info, ckpt, worker, placement)
        problems += [f"worker {worker} at {endpoint}: {d}" for d in diffs]
        infos.append(info)
        if not diffs:
            logger.info(
                "worker %d at %s holds experts %s (kernel backend %s)",
                worker, endpoint, [(r.start, r.end) for r in info.expert_ranges], info.kernel_backend,
            )
    if problems:
        raise WorkerMismatchError(
            f"expert workers do not match model {ckpt.path} (fingerprint {ckpt.fingerprint}):\n  "
            + "\n  ".join(problems)
        )
    return infos, placement
