"""Start-up check: every worker must hold the model and shard this server expects."""
from __future__ import annotations

import logging

import grpc

from protos import PROTOCOL_VERSION, GRPC_OPTIONS, codec
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import MoeCheckpoint
from protos.placement import Placement

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


def fetch_info(worker: int, endpoint: str, ready_timeout_s: float) -> pb.InfoResponse:
    """The worker's Info, once it answers; WorkerMismatchError when it does not in time."""
    with grpc.insecure_channel(endpoint, options=GRPC_OPTIONS) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=ready_timeout_s)
            return pb_grpc.ExpertServiceStub(channel).Info(pb.InfoRequest(), timeout=ready_timeout_s)
        except grpc.FutureTimeoutError:
            raise WorkerMismatchError(f"worker {worker} at {endpoint}: not reachable within {ready_timeout_s:.0f} s") from None
        except grpc.RpcError as err:
            raise WorkerMismatchError(f"worker {worker} at {endpoint}: Info failed: {err.code().name}: {err.details()}") from None


def check_workers(
    endpoints: tuple[str, ...], ckpt: MoeCheckpoint, ready_timeout_s: float, replicas: int | None = None
) -> tuple[list[pb.InfoResponse], Placement]:
    """Wait for each worker, then compare its Info with the placement of `replicas` (None: the
    first worker's); raise WorkerMismatchError naming every difference. Every expert is then held by
    exactly R of the workers."""
    infos, problems, placement = [], [], None
    for worker, endpoint in enumerate(endpoints):
        try:
            info = fetch_info(worker, endpoint, ready_timeout_s)
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
