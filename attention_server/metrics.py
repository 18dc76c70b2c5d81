"""Prometheus metrics of the attention node (names: hetero_moe_<stage>_<what>_<unit>).

The plugin runs in vLLM's engine process, not in the API server process that
serves /metrics. `python -m attention_server` therefore turns on
prometheus_client's multiprocess mode before vLLM starts (as vLLM does itself
when it runs several API servers), and these series appear on vLLM's own
/metrics beside its `vllm:` ones. Labels are bounded: worker index, MoE layer, cause.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

DISPATCH_MESSAGES = Counter("hetero_moe_dispatch_messages", "Forward messages sent to each expert worker", ["worker"])
DISPATCH_ROWS = Counter("hetero_moe_dispatch_rows", "Token rows sent to each expert worker", ["worker"])
DISPATCH_PAIRS = Counter("hetero_moe_dispatch_pairs", "(token, expert) pairs sent to each expert worker", ["worker"])
ROUTED_TOKENS = Counter("hetero_moe_route_tokens", "Tokens routed to remote experts, per MoE layer", ["layer"])
# From 50 µs: a MoE layer of the tiny model takes well under a millisecond.
_STEP_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
STEP_FORWARD = Histogram("hetero_moe_step_forward_seconds", "One step's model forward on the attention node",
                         buckets=_STEP_BUCKETS)  # fmt: skip
STEP_EXPERT_WAIT = Histogram(
    "hetero_moe_step_expert_wait_seconds", "Time in a step's forward blocked waiting for the expert workers",
    buckets=_STEP_BUCKETS,
)
STEP_COMBINE = Histogram("hetero_moe_step_combine_seconds", "Time in a step's forward combining the workers' partials",
                         buckets=_STEP_BUCKETS)  # fmt: skip
STEP_ATTENTION = Histogram(
    "hetero_moe_step_attention_seconds",
    "The rest of a step's forward: attention, routers, dispatch and shared experts", buckets=_STEP_BUCKETS,
)
STEP_OVERLAP = Histogram(
    "hetero_moe_step_overlap_ratio", "Share of a step's forward not blocked on the experts (1 - wait / forward)",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
)
PINGPONG_STEPS = Counter(
    "hetero_moe_pingpong_steps", "Model steps by the number of micro-batches they ran in (1: not split)", ["microbatches"]
)
TRANSPORT_PLANE = Gauge(
    "hetero_moe_transport_plane", "1 for the data plane that carries each worker's frames", ["worker", "plane"],
    multiprocess_mode="livemax",
)
WORKER_UP = Gauge("hetero_moe_transport_worker_up", "1 while an expert worker gets work, 0 while it is down",
                  ["worker"], multiprocess_mode="livemax")  # fmt: skip
WORKER_FAILURES = Counter(
    "hetero_moe_transport_worker_failures", "Expert workers marked down, by cause (unavailable, deadline)", ["worker", "cause"]
)
FAILOVERS = Counter("hetero_moe_transport_failovers", "Slices re-sent to another replica, by the worker that took them",
                    ["worker"])  # fmt: skip
WORKER_DEADLINE = Gauge("hetero_moe_transport_deadline_seconds",
                        "How long the attention node waits for each worker's answer before it fails over",
                        ["worker"], multiprocess_mode="livemax")  # fmt: skip
REJOINS = Counter("hetero_moe_transport_rejoins", "Expert workers put back after being down", ["worker"])


@dataclass(slots=True)
class StepTimes:
    """What the MoE layers of one step spent, added up over its layers and micro-batches."""

    expert_wait_s: float = 0.0
    combine_s: float = 0.0

    def publish(self, forward_s: float, microbatches: int) -> None:
        PINGPONG_STEPS.labels(str(microbatches)).inc()
        STEP_FORWARD.observe(forward_s)
        STEP_EXPERT_WAIT.observe(self.expert_wait_s)
        STEP_COMBINE.observe(self.combine_s)
        STEP_ATTENTION.observe(max(0.0, forward_s - self.expert_wait_s - self.combine_s))
        STEP_OVERLAP.observe(1.0 - self.expert_wait_s / forward_s if forward_s > 0 else 1.0)
        self.expert_wait_s = self.combine_s = 0.0


class DispatchCounts:
    """What the plugin sent, added up over a step and published once per step.

    prometheus_client's multiprocess counters cost about a microsecond or two per increment, and
    one layer would make a dozen; the totals on /metrics are current after every step.
    """

    def __init__(self, num_workers: int):
        self.sent = [[0, 0, 0] for _ in range(num_workers)]  # per worker: messages, rows, pairs
        self.routed: dict[int, int] = {}  # tokens per MoE layer
        workers = [str(w) for w in range(num_workers)]
        self._series = [
            [DISPATCH_MESSAGES.labels(w), DISPATCH_ROWS.labels(w), DISPATCH_PAIRS.labels(w)] for w in workers
        ]

    def add(self, layer: int, num_tokens: int, answered) -> None:
        """answered: (worker, slice) of each request a worker computed."""
        self.routed[layer] = self.routed.get(layer, 0) + num_tokens
        for worker, part in answered:
            sent = self.sent[worker]
            sent[0] += 1
            sent[1] += len(part.rows)
            sent[2] += part.num_pairs

    def publish(self) -> None:
        for sent, series in zip(self.sent, self._series):
            if sent[0]:
                for value, counter in zip(sent, series):
                    counter.inc(value)
                sent[:] = [0, 0, 0]
        for layer, tokens in self.routed.items():
            ROUTED_TOKENS.labels(str(layer)).inc(tokens)
        self.routed.clear()
