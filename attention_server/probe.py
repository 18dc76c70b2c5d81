"""python -m attention_server.probe HOST:PORT[,HOST:PORT ...] (--tls-dir DIR | --plaintext) [--json]

Measures, from this host, the round trip to each expert worker on every data plane it offers
that reaches it from here (shared memory only from the worker's own host): latency of a small
echo and bandwidth of a large one, through the same channels the attention server uses. Reports
what it measured and nothing else; a plane it could not reach is listed with the reason.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from attention_server.config import parse_endpoint
from attention_server.handshake import WorkerMismatchError, fetch_info
from attention_server.transport.base import ExpertWorkerError
from attention_server.transport.factory import PlaneUnavailable, open_channel
from protos.security import Security, add_flags

SMALL, LARGE = 4 << 10, 8 << 20  # bytes each way
PLANES = ("shm", "tcp", "grpc")


def echo_times(channel, payload: memoryview, iterations: int) -> list[float]:
    channel.receive(channel.send_echo(payload))  # connect, map, warm
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        channel.receive(channel.send_echo(payload))
        times.append(time.perf_counter() - start)
    return sorted(times)


def probe_worker(worker: int, endpoint: str, timeout_s: float, iterations: int, security: Security) -> dict:
    info = fetch_info(worker, endpoint, timeout_s, security)
    planes = {}
    for plane in PLANES:
        try:
            channel = open_channel(worker, endpoint, info, plane, timeout_s, security)
        except (PlaneUnavailable, ExpertWorkerError) as err:
            planes[plane] = {"unavailable": str(err)}
            continue
        try:
            small = echo_times(channel, memoryview(bytes(SMALL)), iterations)
            large = echo_times(channel, memoryview(torch.zeros(LARGE, dtype=torch.uint8).numpy()), max(3, iterations // 20))
        except ExpertWorkerError as err:
            planes[plane] = {"failed": str(err)}
            continue
        finally:
            channel.close()
        planes[plane] = {
            "latency_p50_ms": statistics.median(small) * 1e3,
            "latency_p99_ms": small[min(len(small) - 1, int(len(small) * 0.99))] * 1e3,
            "bandwidth_gb_per_s": 2 * LARGE / statistics.median(large) / 1e9,
            "echo_bytes": {"latency": SMALL, "bandwidth": LARGE},
            "round_trips": {"latency": len(small), "bandwidth": len(large)},
        }
    return {"worker": worker, "endpoint": endpoint, "kernel_backend": info.kernel_backend, "planes": planes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attention_server.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("endpoints", help="HOST:PORT of each worker's gRPC port, comma-separated")
    add_flags(p)
    p.add_argument("--iterations", type=int, default=200, help="latency round trips per plane")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a worker")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    endpoints = [e.strip() for e in a.endpoints.split(",") if e.strip()]
    try:
        for e in endpoints:
            parse_endpoint(e)
        security = Security.from_flags(a.tls_dir, a.plaintext, "attention")
        results = [probe_worker(w, e, a.timeout, a.iterations, security) for w, e in enumerate(endpoints)]
    except (ValueError, WorkerMismatchError) as err:
        print(f"probe: {err}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'worker':>6}  {'endpoint':22} {'plane':5}  {'p50 ms':>8} {'p99 ms':>8} {'GB/s':>7}   "
          f"(latency: {SMALL >> 10} KiB echo; bandwidth: {LARGE >> 20} MiB echo, both directions)")  # fmt: skip
    for r in results:
        for plane, m in r["planes"].items():
            if "latency_p50_ms" in m:
                print(f"{r['worker']:>6}  {r['endpoint']:22} {plane:5}  {m['latency_p50_ms']:8.3f} "
                      f"{m['latency_p99_ms']:8.3f} {m['bandwidth_gb_per_s']:7.2f}")  # fmt: skip
            else:
                print(f"{r['worker']:>6}  {r['endpoint']:22} {plane:5}  not measured: {m.get('unavailable') or m['failed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
