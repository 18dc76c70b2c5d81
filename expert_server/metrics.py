"""Prometheus metrics of one expert worker (names: hetero_moe_worker_<what>_<unit>)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info, start_http_server

REQUESTS = Counter("hetero_moe_worker_requests", "Forward RPCs by final gRPC status", ["status"])
FORWARD_SECONDS = Histogram(
    "hetero_moe_worker_forward_seconds",
    "Forward RPC time in the worker: decode, expert compute and encode",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
BYTES_RECEIVED = Counter("hetero_moe_worker_received_bytes", "Tensor payload bytes received in Forward requests")
BYTES_SENT = Counter("hetero_moe_worker_sent_bytes", "Tensor payload bytes sent in Forward responses")
ROWS = Counter("hetero_moe_worker_rows", "Token rows computed")
PAIRS = Counter("hetero_moe_worker_pairs", "(token row, expert) pairs computed")
UP = Gauge("hetero_moe_worker_up", "1 while the worker serves, 0 while it loads or drains")
BENCH_REPLY_DELAY = Gauge(
    "hetero_moe_worker_bench_reply_delay_seconds",
    "Emulated pool-B latency added to every reply, fixed and per row (benchmarks only; else 0)", ["part"],
)
PLACES = Counter("hetero_moe_worker_places", "Place RPCs (extra experts re-placed) by final gRPC status", ["status"])
PLACEMENT_EPOCH = Gauge("hetero_moe_worker_placement_epoch", "The last Place epoch this worker took (0: none)")
EXTRA_EXPERTS = Gauge("hetero_moe_worker_extra_experts",
                      "(layer, expert)s held beside the shards, for the current and the previous placement epoch")
EXTRA_EXPERT_BYTES = Gauge("hetero_moe_worker_extra_expert_bytes", "Weights of those extra experts as loaded")
SHARD = Info("hetero_moe_worker_shard", "What this worker serves: its index, experts and kernel backend")


def publish_placement(epoch: int, extra_experts: int, extra_bytes: int) -> None:
    PLACEMENT_EPOCH.set(epoch)
    EXTRA_EXPERTS.set(extra_experts)
    EXTRA_EXPERT_BYTES.set(extra_bytes)


def serve_metrics(host: str, port: int) -> None:
    start_http_server(port, addr=host)
