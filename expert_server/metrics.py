"""Prometheus metrics of one expert worker (names: hetero_moe_worker_<what>_<unit>)."""
from __future__ import annotations

import itertools

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from expert_server import native

# The request metrics count in Python (these objects, unregistered) and in the shared-memory
# plane's C loop (NATIVE); what a scrape sees is their sum (_Served).
REQUESTS = Counter("hetero_moe_worker_requests", "Forward RPCs by final gRPC status", ["status"], registry=None)
FORWARD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
FORWARD_SECONDS = Histogram("hetero_moe_worker_forward_seconds",
                            "Forward RPC time in the worker: decode, expert compute and encode",
                            buckets=FORWARD_BUCKETS, registry=None)  # fmt: skip
BYTES_RECEIVED = Counter("hetero_moe_worker_received_bytes", "Tensor payload bytes received in Forward requests",
                         registry=None)  # fmt: skip
BYTES_SENT = Counter("hetero_moe_worker_sent_bytes", "Tensor payload bytes sent in Forward responses", registry=None)
ROWS = Counter("hetero_moe_worker_rows", "Token rows computed", registry=None)
PAIRS = Counter("hetero_moe_worker_pairs", "(token row, expert) pairs computed", registry=None)
NATIVE = native.new_counts(FORWARD_BUCKETS)


class _Served(Collector):
    """The request metrics as Python counted them plus what the C loop counted (all OK)."""

    def collect(self):
        c = NATIVE
        totals = {REQUESTS: c.ok, BYTES_RECEIVED: c.received_bytes, BYTES_SENT: c.sent_bytes, ROWS: c.rows,
                  PAIRS: c.pairs}  # fmt: skip
        for metric, native_total in totals.items():
            for family in metric.collect():
                family.samples = [s._replace(value=s.value + native_total)
                                  if s.name.endswith("_total") and s.labels.get("status", "OK") == "OK" else s
                                  for s in family.samples]  # fmt: skip
                yield family
        cumulative = list(itertools.accumulate(c.buckets[: c.num_bounds + 1]))
        for family in FORWARD_SECONDS.collect():
            bucket = iter(cumulative)
            family.samples = [s._replace(value=s.value + (next(bucket) if s.name.endswith("_bucket") else
                                                          cumulative[-1] if s.name.endswith("_count") else
                                                          c.seconds_ns * 1e-9 if s.name.endswith("_sum") else 0))
                              for s in family.samples]  # fmt: skip
            yield family
        yield CounterMetricFamily("hetero_moe_worker_native_requests",
                                  "Forward requests the shared-memory plane's C loop answered (in requests_total too)",
                                  value=c.ok)  # fmt: skip


REGISTRY.register(_Served())
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
