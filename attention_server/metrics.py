"""Prometheus metrics of the attention node (names: hetero_moe_<stage>_<what>_<unit>).

The plugin runs in vLLM's engine process, not in the API server process that
serves /metrics. `python -m attention_server` therefore turns on
prometheus_client's multiprocess mode before vLLM starts (as vLLM does itself
when it runs several API servers), and these series appear on vLLM's own
/metrics beside its `vllm:` ones. Labels are bounded: worker index, MoE layer, cause,
rank among a layer's LOAD_TOP_N busiest experts; never one series per expert.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from attention_server.load.window import BALANCE_OVER, LoadView
from protos import frames

DISPATCH_MESSAGES = Counter("hetero_moe_dispatch_messages", "Forward messages sent to each expert worker", ["worker"])
DISPATCH_ROWS = Counter("hetero_moe_dispatch_rows", "Token rows sent to each expert worker", ["worker"])
DISPATCH_PAIRS = Counter("hetero_moe_dispatch_pairs", "(token, expert) pairs sent to each expert worker", ["worker"])
DISPATCH_BYTES_SENT = Counter("hetero_moe_dispatch_sent_bytes",
                              "Payload bytes (rows and pairs) sent to each expert worker, on any plane", ["worker"])  # fmt: skip
DISPATCH_BYTES_RECEIVED = Counter("hetero_moe_dispatch_received_bytes",
                                  "Payload bytes of the partials each expert worker sent back", ["worker"])  # fmt: skip
ROUTED_TOKENS = Counter("hetero_moe_route_tokens", "Tokens routed to remote experts, per MoE layer", ["layer"])
ROUTED_PAIRS = Counter("hetero_moe_route_pairs", "(token, expert) pairs routed to remote experts, per MoE layer",
                       ["layer"])  # fmt: skip
EXPERT_IMBALANCE = Histogram(
    "hetero_moe_route_expert_imbalance_ratio",
    "Per MoE layer and step: the busiest expert's pairs over the mean per expert (1: balanced; at most E / top-k "
    "for one token). One series for all layers and experts; the full per-expert view is issue 12's.",
    buckets=(1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0),
)
# From 50 µs: a MoE layer of the tiny model takes well under a millisecond.
_STEP_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
ROUND_TRIP = Histogram(
    "hetero_moe_transport_round_trip_seconds",
    "From sending a request to a worker to reading its answer (under ping-pong this includes the other "
    "micro-batch's attention, run while the answer was on its way)", ["worker"], buckets=_STEP_BUCKETS,
)
STEP_FORWARD = Histogram("hetero_moe_step_forward_seconds", "One step's model forward on the attention node",
                         buckets=_STEP_BUCKETS)  # fmt: skip
STEP_EXPERT_WAIT = Histogram(
    "hetero_moe_step_expert_wait_seconds", "Time in a step's forward blocked waiting for the expert workers",
    buckets=_STEP_BUCKETS,
)
STEP_COMBINE = Histogram("hetero_moe_step_combine_seconds", "Time in a step's forward combining the workers' partials",
                         buckets=_STEP_BUCKETS)  # fmt: skip
STEP_DISPATCH = Histogram(
    "hetero_moe_step_dispatch_seconds", "Time in a step's forward sending rows to the expert workers (routing, "
    "partition, frames)", buckets=_STEP_BUCKETS,
)
STEP_ATTENTION = Histogram(
    "hetero_moe_step_attention_seconds",
    "The rest of a step's forward: attention, routers and shared experts", buckets=_STEP_BUCKETS,
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
TRANSPORT_ERRORS = Counter(
    "hetero_moe_transport_errors",
    "Requests to a worker that failed, by cause: unavailable and deadline take the worker down (counted once per "
    "outage, its slices fail over), refused is the worker's error answer to one request", ["worker", "cause"],
)
FAILOVERS = Counter("hetero_moe_transport_failovers", "Slices re-sent to another replica, by the worker that took them",
                    ["worker"])  # fmt: skip
WORKER_DEADLINE = Gauge("hetero_moe_transport_deadline_seconds",
                        "How long the attention node waits for each worker's answer before it fails over",
                        ["worker"], multiprocess_mode="livemax")  # fmt: skip
REJOINS = Counter("hetero_moe_transport_rejoins", "Expert workers put back after being down", ["worker"])
# The expert load window (attention_server/load): 2 x L x (LOAD_TOP_N + 1) series for L MoE layers.
# Set when the ring starts a bucket and when the view is read; the full per-expert view is JSON.
LOAD_TOP_N = 3
LOAD_BALANCE = Gauge(
    "hetero_moe_expert_load_balance",
    "Per MoE layer, over the expert load window: the busiest expert's (or shard's) tokens over the mean (1: balanced)",
    ["layer", "over"], multiprocess_mode="livemostrecent",
)
LOAD_TOP_EXPERT = Gauge("hetero_moe_expert_load_top_expert",
                        "Per MoE layer, over the expert load window: the id of its rank-th busiest expert",
                        ["layer", "rank"], multiprocess_mode="livemostrecent")  # fmt: skip
LOAD_TOP_TOKENS = Gauge(
    "hetero_moe_expert_load_top_token_ratio",
    "Per MoE layer, over the expert load window: the share of its tokens routed to its rank-th busiest expert",
    ["layer", "rank"], multiprocess_mode="livemostrecent",
)


# Hot experts on the attention node (attention_server/hot.py): four series.
HOT_EXPERTS = Gauge("hetero_moe_hot_experts", "Routed experts (of all layers) computed on the attention node",
                    multiprocess_mode="livemostrecent")  # fmt: skip
HOT_BYTES = Gauge("hetero_moe_hot_expert_bytes", "Weight bytes of the routed experts computed on the attention node",
                  multiprocess_mode="livemostrecent")  # fmt: skip
PLACEMENT_EPOCH = Gauge("hetero_moe_placement_epoch",
                        "Placements taken so far: hot sets on the attention node and expert layouts on the workers",
                        multiprocess_mode="livemostrecent")  # fmt: skip
HOT_PAIRS = Counter("hetero_moe_hot_pairs", "(token, expert) pairs computed on the attention node by its hot experts")


# Re-placement on the workers (attention_server/replace.py): one series.
REPLACED_EXPERTS = Gauge("hetero_moe_replaced_experts",
                         "Routed experts' shares (of all layers) dealt to a worker other than their home shard's",
                         multiprocess_mode="livemostrecent")  # fmt: skip


def publish_hot(experts: int, nbytes: int) -> None:
    HOT_EXPERTS.set(experts)
    HOT_BYTES.set(nbytes)


def publish_load(view: LoadView) -> None:
    for over in BALANCE_OVER:
        for layer, value in zip(view.layers, view.balance(over).tolist()):
            LOAD_BALANCE.labels(str(layer), over).set(value)
    ids, shares = view.top(view.window, LOAD_TOP_N)
    for layer, layer_ids, layer_shares in zip(view.layers, ids.tolist(), shares.tolist()):
        for rank, (expert, share) in enumerate(zip(layer_ids, layer_shares), start=1):
            LOAD_TOP_EXPERT.labels(str(layer), str(rank)).set(expert)
            LOAD_TOP_TOKENS.labels(str(layer), str(rank)).set(share)


@dataclass(slots=True)
class StepTimes:
    """What the MoE layers of one step spent, added up over its layers and micro-batches."""

    dispatch_s: float = 0.0
    expert_wait_s: float = 0.0
    combine_s: float = 0.0

    def publish(self, forward_s: float, microbatches: int) -> None:
        PINGPONG_STEPS.labels(str(microbatches)).inc()
        STEP_FORWARD.observe(forward_s)
        STEP_DISPATCH.observe(self.dispatch_s)
        STEP_EXPERT_WAIT.observe(self.expert_wait_s)
        STEP_COMBINE.observe(self.combine_s)
        STEP_ATTENTION.observe(max(0.0, forward_s - self.dispatch_s - self.expert_wait_s - self.combine_s))
        STEP_OVERLAP.observe(1.0 - self.expert_wait_s / forward_s if forward_s > 0 else 1.0)
        self.dispatch_s = self.expert_wait_s = self.combine_s = 0.0


class DispatchCounts:
    """What the plugin sent, added up over a step and published once per step.

    prometheus_client's multiprocess counters cost about a microsecond or two per increment, and
    one layer would make dozens; the totals on /metrics are current after every step.
    """

    def __init__(self, num_workers: int):
        self.sent = [[0, 0, 0, 0, 0] for _ in range(num_workers)]  # per worker: messages, rows, pairs, bytes out, in
        self.routed: dict[int, list] = {}  # per MoE layer: [tokens, pairs per expert [E]]
        self.hot_pairs = 0  # computed by the attention node's hot experts
        workers = [str(w) for w in range(num_workers)]
        self._series = [
            [DISPATCH_MESSAGES.labels(w), DISPATCH_ROWS.labels(w), DISPATCH_PAIRS.labels(w),
             DISPATCH_BYTES_SENT.labels(w), DISPATCH_BYTES_RECEIVED.labels(w)] for w in workers
        ]  # fmt: skip

    def add(self, layer: int, plan, width: int, itemsize: int, workers: list[int], hot_pairs: int = 0) -> None:
        """plan: the layer's DispatchPlan for a [T, width] input of `itemsize`-byte elements;
        workers: the worker that computed each of its slices; hot_pairs: pairs computed here."""
        self.hot_pairs += hot_pairs
        routed = self.routed.get(layer)
        if routed is None:
            self.routed[layer] = [plan.num_tokens, plan.expert_pairs.copy()]
        else:
            routed[0] += plan.num_tokens
            routed[1] += plan.expert_pairs
        for worker, part in zip(workers, plan.slices):
            rows, pairs = len(part.rows), part.num_pairs
            sent = self.sent[worker]
            sent[0] += 1
            sent[1] += rows
            sent[2] += pairs
            sent[3] += frames.forward_payload(rows, width, itemsize, pairs)
            sent[4] += frames.partial_payload(rows, width)

    def publish(self) -> None:
        for sent, series in zip(self.sent, self._series):
            if sent[0]:
                for value, counter in zip(sent, series):
                    counter.inc(value)
                sent[:] = [0, 0, 0, 0, 0]
        for layer, (tokens, expert_pairs) in self.routed.items():
            label = str(layer)
            ROUTED_TOKENS.labels(label).inc(tokens)
            ROUTED_PAIRS.labels(label).inc(int(expert_pairs.sum()))
            EXPERT_IMBALANCE.observe(float(expert_pairs.max() / expert_pairs.mean()))
        self.routed.clear()
        if self.hot_pairs:
            HOT_PAIRS.inc(self.hot_pairs)
            self.hot_pairs = 0
