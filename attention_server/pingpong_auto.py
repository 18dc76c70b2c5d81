"""`--pingpong-microbatches auto`: m per step from MegaScale-Infer's model, checked by measurement.

Per MoE layer, with the attention node's own time b (attention, routers, dispatch, combine) and
the experts' round trip r, one micro-batch (m = 1) takes b + r. Cut into m micro-batches, the
node's time grows by a fixed overhead o per extra micro-batch, b(m) = b + (m - 1)·o, and a
micro-batch's round trip shrinks to r(m) = c + (r - c)/m, c being the part that does not shrink
with its rows (the transport's latency, per-request costs). Micro-batch i waits for its experts
while the others run their attention, so a layer takes the longer of the node's time and one
micro-batch's cycle (DESIGN.md §4):

    t(m) = max(b(m), b(m)/m + r(m))

b and r are measured on steps that run whole; o on a step at any m > 1 (its node time); c on a
step at m > 1 that waited for its experts (its layer time then is the cycle). The model leaves out
what a real step adds (the pipeline's fill and drain, thread hand-offs that cost more on a busy
host), so it only proposes: an m that has run is judged by its measured layer time, and the
model's t(m) stands in for those that have not.

Every figure is the median of its last WINDOW values, per batch size (a power-of-two bucket of
the step's tokens): one slow step (a pause, the first decode after a prefill) moves nothing. An m
is measured over MIN_SAMPLES steps in a row before it is judged. The first batch size runs whole
first, then at m = 2, then at whatever the figures favour. Served requests come and go, so the
batch size keeps moving, and o and c belong to the node and the transport more than to a batch
size: a batch size seen later starts at the m its nearest neighbour with an o runs, and takes that
neighbour's o and c until it has its own. A step of it that waited for its experts gives its b =
node - (m - 1)·o and r = m·layer - node - (m - 1)·c; one that did not wait tells neither (its
experts' time was hidden), and a smaller m runs next, down to m = 1. A batch size that has not yet
run split measures the split the model favours once, whatever the borrowed figures predict for
m = 1. A measurement not renewed within EXPIRE_STEPS steps of its bucket is dropped, so that a
changed load is measured again. Meanwhile the m that runs is measured on every step and the others
not at all, so a few slow steps of an m (a busy moment of the host) would keep it off for those
EXPIRE_STEPS: every REPROBE_STEPS steps of a bucket, the m not run for that long whose last figure
came closest to the best's (within REPROBE_MARGIN) is measured afresh. A batch of fewer than 2
requests runs whole.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 9  # values per median
MIN_SAMPLES = 3  # steps in a row an m runs before it is judged
EXPIRE_STEPS = 500  # steps of a bucket after which an m not run since is measured again
MIN_GAIN = 0.03  # another m must be this much faster than the best measured one to be run
REPROBE_STEPS = 48  # steps of a bucket between two fresh measurements of an m that is not running
REPROBE_MARGIN = 0.15  # ... of one whose last figure is at most this much slower than the best's
WAIT_BOUND = 0.05  # a split step whose wait is at least this share of its layer time measures c


class Recent:
    """The median of the last WINDOW values, and the step of the last one."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=WINDOW)
        self.seen = 0

    def add(self, value: float, step: int) -> None:
        self.values.append(value)
        self.seen = step

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def __len__(self) -> int:
        return len(self.values)


@dataclass(slots=True)
class LayerTimes:
    """One bucket's figures, seconds per MoE layer."""

    node: Recent = field(default_factory=Recent)  # b: the attention node's own time, m = 1
    round_trip: Recent = field(default_factory=Recent)  # r: waiting for the experts, m = 1
    overhead: Recent = field(default_factory=Recent)  # o: node time added by each extra micro-batch
    fixed: Recent = field(default_factory=Recent)  # c: the part of r that does not shrink with the rows
    measured: dict[int, Recent] = field(default_factory=dict)  # layer time at each m
    steps: int = 0  # steps of this bucket so far
    last: int = 1  # the m of the last step
    reprobed: int = 0  # the step of this bucket when an m was last measured afresh

    def samples(self, m: int) -> int:
        """Current measurements of m (none once expired)."""
        recent = self.measured.get(m)
        if recent is None or self.steps - recent.seen >= EXPIRE_STEPS:
            return 0
        return len(recent)

    def predict(self, m: int, o: float, c: float) -> float:
        """t(m) from the model, with overhead o and fixed part c; needs node and round_trip."""
        b, r = self.node.median, self.round_trip.median
        if m == 1:
            return b + r
        node = b + (m - 1) * o
        return max(node, node / m + c + (r - c) / m)


class AutoMicroBatches:
    """Chooses each step's m and learns from how the step went."""

    def __init__(self, max_microbatches: int):
        self.max_microbatches = max_microbatches
        self.buckets: dict[int, LayerTimes] = {}

    def _times(self, num_tokens: int) -> LayerTimes:
        return self.buckets.setdefault(num_tokens.bit_length(), LayerTimes())

    def _neighbour(self, num_tokens: int) -> LayerTimes | None:
        """The nearest other bucket (the smaller on a tie) with an o of its own."""
        key = num_tokens.bit_length()
        known = [k for k, t in self.buckets.items() if k != key and len(t.overhead)]
        return self.buckets[min(known, key=lambda k: (abs(k - key), k))] if known else None

    def _model(self, num_tokens: int, times: LayerTimes) -> tuple[float | None, float]:
        """(o, c) for a bucket: its own, else its nearest neighbour's; o None while neither has one,
        c 0.0 while unknown (the most a split can gain)."""
        source = times if len(times.overhead) else self._neighbour(num_tokens)
        if source is None:
            return None, 0.0
        return source.overhead.median, (source.fixed.median if len(source.fixed) else 0.0)

    def choose(self, num_tokens: int, num_reqs: int) -> int:
        limit = min(self.max_microbatches, num_reqs)
        if limit < 2:
            return 1
        times = self._times(num_tokens)
        if times.last <= limit and 0 < times.samples(times.last) < MIN_SAMPLES:
            return times.last  # measuring it
        if not len(times.node):  # no b and r for this batch size yet
            neighbour = self._neighbour(num_tokens)
            if neighbour is None:
                return 1
            # an m whose steps did not wait hid its experts' time: the next try is a smaller m
            tried = [m for m in range(2, limit + 1) if times.samples(m)]
            return max(1, min(neighbour.last, limit, min(tried, default=limit + 1) - 1))
        if times.samples(1) == 0 and times.steps - times.node.seen >= EXPIRE_STEPS:
            return 1  # b and r have expired with m = 1's figure: measured afresh
        o, c = self._model(num_tokens, times)
        if o is None:
            return 2
        estimate = {m: times.measured[m].median if times.samples(m) else times.predict(m, o, c)
                    for m in range(1, limit + 1)}  # fmt: skip
        if not len(times.overhead):  # never split at this size: a neighbour's o and c only propose
            return min(range(2, limit + 1), key=estimate.get)
        best = 1
        for m in range(2, limit + 1):
            if estimate[m] < estimate[best] * (1 - MIN_GAIN):
                best = m
        if times.steps - times.reprobed >= REPROBE_STEPS:
            stale = [m for m in estimate if m != best and times.samples(m)
                     and times.steps - times.measured[m].seen >= REPROBE_STEPS]  # fmt: skip
            if stale and estimate[m := min(stale, key=estimate.get)] <= estimate[best] * (1 + REPROBE_MARGIN):
                times.reprobed = times.steps
                times.measured[m] = Recent()  # measured afresh from its next step on
                return m
        return best

    def observe(self, m: int, num_tokens: int, moe_layers: int, forward_s: float, wait_s: float) -> None:
        """A step of num_tokens tokens that ran as m micro-batches: its forward and the time it
        spent blocked on the workers, summed over its layers."""
        if moe_layers == 0 or forward_s <= 0:
            return
        times = self._times(num_tokens)
        times.steps += 1
        if not times.samples(m):
            times.measured[m] = Recent()  # expired: measured afresh
        layer, wait = forward_s / moe_layers, wait_s / moe_layers
        times.measured[m].add(layer, times.steps)
        times.last = m
        node = layer - wait
        if m == 1:
            times.node.add(node, times.steps)
            times.round_trip.add(wait, times.steps)
            return
        # the micro-batches waited, so the layer is their cycle: layer = node/m + c + (r - c)/m
        waited = wait >= WAIT_BOUND * layer
        if not len(times.node):
            o, c = self._model(num_tokens, times)
            if waited and o is not None:  # started at a neighbour's m: b and r from its o and c
                times.node.add(max(0.0, node - (m - 1) * o), times.steps)
                times.round_trip.add(max(c, m * layer - node - (m - 1) * c), times.steps)
            return
        b, r = times.node.median, times.round_trip.median
        times.overhead.add(max(0.0, (node - b) / (m - 1)), times.steps)
        if waited:
            times.fixed.add(min(max((layer - node / m - r / m) / (1 - 1 / m), 0.0), r), times.steps)
