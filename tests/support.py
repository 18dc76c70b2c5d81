"""Helpers for tests that start real processes: free loopback ports, workers, HTTP readiness."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.launcher import stop_pids

HOST = "127.0.0.1"
# The CPU flags every vLLM in the tests runs with, stock or cluster.
VLLM_CPU_ARGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind((HOST, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Processes:
    """Children started in their own sessions, stopped as groups at teardown."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        stop_pids({n: p.pid for n, p in self.procs.items()}, reap=lambda: [p.poll() for p in self.procs.values()])
        for p in self.procs.values():
            p.wait()
        self.procs.clear()


@dataclass
class Workers:
    endpoints: list[str]
    procs: Processes
    metrics_urls: list[str]


def wait_serving(endpoint: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"worker at {endpoint} exited with {proc.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"worker at {endpoint} not serving after {timeout_s} s")


def start_workers(procs: Processes, model: Path, num_workers: int, tag: str, extra_args: tuple[str, ...] = ()) -> Workers:
    """Real expert_server processes on loopback, one per worker index, each with /metrics."""
    ports = free_ports(2 * num_workers)
    ports, metrics_ports = ports[:num_workers], ports[num_workers:]
    endpoints = []
    for i, port in enumerate(ports):
        procs.start(f"{tag}-worker-{i}", python_module(
            "expert_server", "--model", str(model), "--worker-index", str(i), "--num-workers", str(num_workers),
            "--host", HOST, "--port", str(port), "--metrics-port", str(metrics_ports[i]), "--num-threads", "1",
            *extra_args))  # fmt: skip
        endpoints.append(f"{HOST}:{port}")
    for i, endpoint in enumerate(endpoints):
        wait_serving(endpoint, procs.procs[f"{tag}-worker-{i}"])
    return Workers(endpoints, procs, [f"http://{HOST}:{p}/metrics" for p in metrics_ports])


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
