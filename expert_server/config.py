"""The expert worker's configuration: one frozen dataclass built from CLI flags."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from protos import security
from protos.placement import replicas_flag

WEIGHT_FORMATS = ("checkpoint", "w4a16")
DATA_PLANES = ("tcp", "shm")  # offered besides gRPC, which every worker serves
CPU_SCHEDULING = ("batch", "normal")
BENCHMARK_ENV = "HETERO_MOE_BENCHMARK"  # "1" lets benchmarks emulate pool-B latency (--bench-reply-delay-ms)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: Path
    worker_index: int
    num_workers: int
    port: int
    tls_dir: Path | None  # mutual TLS and the cluster token from here (protos/security.py); None: --plaintext
    expert_replicas: int | None = None  # R: workers holding each shard (protos/placement.py); None: 2 if they fit
    host: str = "127.0.0.1"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    metrics_port: int | None = None  # Prometheus /metrics; None serves none
    weight_format: str = "checkpoint"  # "checkpoint": as stored; "w4a16": quantize 16-bit experts on load
    kernel_backend: str | None = None  # force a backend; None lets the oracle choose
    group_size: int = 128  # quantize-on-load group
    data_planes: tuple[str, ...] = DATA_PLANES
    data_port: int = 0  # TCP data plane port; 0 picks a free one (Info tells the attention node)
    cpu_scheduling: str = "batch"  # Linux policy of every worker thread (SCHED_BATCH or SCHED_OTHER)
    bench_reply_delay_ms: float = 0.0  # benchmarks only: hold each shm/tcp Forward reply this long,
    bench_reply_delay_us_per_row: float = 0.0  # plus this per token row it carries

    def __post_init__(self) -> None:
        if not self.model.is_dir():
            raise ValueError(f"--model {self.model} is not a directory")
        if self.num_workers < 1:
            raise ValueError(f"--num-workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"--worker-index {self.worker_index} is outside [0, {self.num_workers})")
        if self.expert_replicas is not None and not 1 <= self.expert_replicas <= self.num_workers:
            raise ValueError(f"--expert-replicas must be 1 to {self.num_workers} (--num-workers), got {self.expert_replicas}")
        if self.tls_dir is not None and not self.tls_dir.is_dir():
            raise ValueError(f"--tls-dir {self.tls_dir} is not a directory")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"--weight-format {self.weight_format!r} is not one of {WEIGHT_FORMATS}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"--group-size must be 32, 64 or 128, got {self.group_size}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port} is not a TCP port")
        if unknown := set(self.data_planes) - set(DATA_PLANES):
            raise ValueError(f"--data-planes: unknown {sorted(unknown)}; choose from {DATA_PLANES}")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--data-port {self.data_port} is not a TCP port")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.cpu_scheduling not in CPU_SCHEDULING:
            raise ValueError(f"--cpu-scheduling {self.cpu_scheduling!r} is not one of {CPU_SCHEDULING}")
        if self.bench_reply_delay_ms < 0 or self.bench_reply_delay_us_per_row < 0:
            raise ValueError("--bench-reply-delay-ms and --bench-reply-delay-us-per-row must be >= 0")
        if (self.bench_reply_delay_ms or self.bench_reply_delay_us_per_row) and os.environ.get(BENCHMARK_ENV) != "1":
            raise ValueError(f"--bench-reply-delay-* slows every answer down: benchmarks only ({BENCHMARK_ENV}=1)")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> WorkerConfig:
        p = argparse.ArgumentParser(prog="python -m expert_server", description=__doc__)
        p.add_argument("--model", type=Path, required=True, help="HF-format MoE checkpoint directory")
        p.add_argument("--worker-index", type=int, required=True)
        p.add_argument("--num-workers", type=int, required=True)
        p.add_argument("--port", type=int, required=True, help="gRPC port (0 picks a free one)")
        security.add_flags(p)
        p.add_argument("--expert-replicas", type=replicas_flag, default=None, metavar="R|auto",
                       help="hold R shards (this worker's and the R-1 before it, round the ring) so that every expert "
                            "lives on R workers; auto (default): 2 where two shards fit in memory, else 1. Every "
                            "worker and the attention server must agree.")
        p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
        p.add_argument("--device", default="cpu", help="torch device for the experts")
        p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
        p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
        p.add_argument("--weight-format", default="checkpoint", choices=WEIGHT_FORMATS,
                       help="checkpoint: serve experts as stored; w4a16: quantize 16-bit experts on load")
        p.add_argument("--kernel-backend", default=None, help="force hip_fdot2, triton, cpu or reference")
        p.add_argument("--group-size", type=int, default=128, help="quantize-on-load group size (32, 64, 128)")
        p.add_argument("--data-planes", default=",".join(DATA_PLANES),
                       help="data planes to offer besides gRPC: tcp (any host), shm (same host); '' for none")
        p.add_argument("--data-port", type=int, default=0, help="TCP data plane port (0 picks a free one)")
        p.add_argument("--cpu-scheduling", default="batch", choices=CPU_SCHEDULING,
                       help="batch (default): Linux SCHED_BATCH, so a request arriving never preempts the process "
                            "that sent it (on a host shared with the attention node, its fan-out to the other "
                            "workers finishes first); normal: SCHED_OTHER")
        p.add_argument("--bench-reply-delay-ms", type=float, default=0.0, metavar="MS",
                       help=f"benchmarks only ({BENCHMARK_ENV}=1): send each Forward reply on the shm and tcp planes "
                            "MS later, taking the next request meanwhile, to emulate a pool-B GPU and its link on a "
                            "CPU machine (make bench-pingpong)")
        p.add_argument("--bench-reply-delay-us-per-row", type=float, default=0.0, metavar="US",
                       help="benchmarks only: and US microseconds more per token row in the reply")
        a = p.parse_args(argv)
        try:
            tls_dir = security.tls_dir_flag(a.tls_dir, a.plaintext)
        except security.SecurityError as err:
            p.error(str(err))
        return cls(
            model=a.model,
            worker_index=a.worker_index,
            num_workers=a.num_workers,
            port=a.port,
            tls_dir=tls_dir,
            expert_replicas=a.expert_replicas,
            host=a.host,
            device=a.device,
            num_threads=a.num_threads,
            metrics_port=a.metrics_port,
            weight_format=a.weight_format,
            kernel_backend=a.kernel_backend,
            group_size=a.group_size,
            data_planes=tuple(x.strip() for x in a.data_planes.split(",") if x.strip()),
            data_port=a.data_port,
            cpu_scheduling=a.cpu_scheduling,
            bench_reply_delay_ms=a.bench_reply_delay_ms,
            bench_reply_delay_us_per_row=a.bench_reply_delay_us_per_row,
        )
