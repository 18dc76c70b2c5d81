"""python -m expert_server.health HOST:PORT (--tls-dir DIR | --plaintext)

grpc.health.v1 Check of a worker, for container health checks on the worker's own host: exits 0
only when it answers SERVING. With --tls-dir it presents the workers' certificate (worker.crt),
which the cluster's CA signed for client use too; the health service needs no token.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.security import Security, SecurityError, add_flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m expert_server.health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("endpoint", help="HOST:PORT of the worker's gRPC port (its certificate must name HOST)")
    p.add_argument("--timeout", type=float, default=4.0, help="seconds")
    add_flags(p)
    a = p.parse_args(argv)
    try:
        security = Security.from_flags(a.tls_dir, a.plaintext, "worker")
    except SecurityError as err:
        p.error(str(err))
    with security.channel(a.endpoint) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=a.timeout).status
        except grpc.RpcError as err:
            print(f"{a.endpoint}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"{a.endpoint}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
