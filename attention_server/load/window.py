"""Tokens per (MoE layer, expert) over a sliding window, cheap enough to stay on.

The window is a ring of BUCKETS arrays [L, E]. Each MoE layer call adds its DispatchPlan's
expert_pairs (a bincount partition already made) to the current bucket: one numpy add of E
integers, no loop per token; and the pairs each shard computed, as it was sent (W + 1 Python
integers per layer, folded into a second ring [L, W + 1] when a bucket ends or the view is read;
the last column is the attention node's hot experts), so that the shards' balance is measured
under whatever layout served the calls (re-placement, attention_server/replace.py). Once a step the ring advances by the buckets that have elapsed;
a bucket leaving the ring is added to the counts since start. So the window reaches back
between (BUCKETS - 1) / BUCKETS of window_s and window_s.

No Prometheus here: this module is also read by the CLI, in a process that serves no metrics.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

BUCKETS = 12
BALANCE_OVER = ("expert", "shard")


@dataclass(frozen=True, slots=True)
class LoadView:
    """Tokens routed to each (MoE layer, expert): over the window and since the server started
    (vLLM's startup profiling run included).

    layers: [L] model layer index of each row; shards: [E] the home shard (worker, without
    replicas) of each expert; window, total: [L, E] int64; shard_window, shard_total: [L, W + 1]
    int64, the pairs each shard computed (the last column: the attention node's hot experts);
    hot: the experts the attention node computes itself now (attention_server/hot.py), by model
    layer index.
    """

    layers: tuple[int, ...]
    shards: tuple[int, ...]
    top_k: int
    window_s: float  # the window asked for
    covered_s: float  # how far back `window` reaches now (less than window_s in the first window)
    window: np.ndarray
    total: np.ndarray
    shard_window: np.ndarray
    shard_total: np.ndarray
    hot: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def tokens(self, counts: np.ndarray) -> np.ndarray:
        """[L] tokens each layer routed: every token makes top_k (token, expert) pairs."""
        return counts.sum(axis=1) // self.top_k

    def balance(self, over: str, total: bool = False) -> np.ndarray:
        """[L] busiest expert's (or shard's) pairs over the mean, over the window (or since start);
        1 is balanced; NaN for a layer that routed nothing. Over shards: the pairs the workers'
        shards computed, as dealt (the attention node's hot experts are not a worker's)."""
        assert over in BALANCE_OVER, over
        if over == "expert":
            counts = self.total if total else self.window
        else:
            counts = (self.shard_total if total else self.shard_window)[:, :-1]
        mean = counts.mean(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, counts.max(axis=1) / mean, np.nan)

    def top(self, counts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The n busiest experts of each layer, ties to the lower id: ids [L, n] and the share of
        the layer's tokens routed to each [L, n] (0 to 1; NaN for a layer that routed nothing)."""
        ids = np.argsort(-counts, axis=1, kind="stable")[:, :n]
        tokens = self.tokens(counts)[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            return ids, np.where(tokens > 0, np.take_along_axis(counts, ids, axis=1) / tokens, np.nan)

    def to_json(self) -> dict:
        return {
            "layers": list(self.layers), "shards": list(self.shards), "top_k": self.top_k,
            "window_s": self.window_s, "covered_s": self.covered_s,
            "window": self.window.tolist(), "total": self.total.tolist(),
            "shard_window": self.shard_window.tolist(), "shard_total": self.shard_total.tolist(),
            "hot": {str(layer): list(ids) for layer, ids in self.hot.items()},
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> LoadView:
        return cls(tuple(data["layers"]), tuple(data["shards"]), data["top_k"], data["window_s"], data["covered_s"],
                   *(np.asarray(data[key], dtype=np.int64) for key in ("window", "total", "shard_window", "shard_total")),
                   {int(layer): tuple(ids) for layer, ids in data.get("hot", {}).items()})  # fmt: skip


class ExpertLoad:
    """The ring; fed from the MoE layers of the engine process (one at a time, also under ping-pong)."""

    def __init__(self, layers: Sequence[int], shards: np.ndarray, top_k: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        assert window_s > 0, window_s
        self.layers, self.shards, self.top_k, self.window_s = tuple(layers), shards, top_k, window_s
        self.slots = {layer: i for i, layer in enumerate(self.layers)}  # model layer index -> row
        num_shards = int(shards.max()) + 2  # the workers' shards, then the attention node's hot experts
        self._ring = np.zeros((BUCKETS, len(self.layers), len(shards)), dtype=np.int64)
        self._shard_ring = np.zeros((BUCKETS, len(self.layers), num_shards), dtype=np.int64)
        self._retired = np.zeros((len(self.layers), len(shards)), dtype=np.int64)  # buckets that left the ring
        self._shard_retired = np.zeros((len(self.layers), num_shards), dtype=np.int64)
        self._current = 0
        self._bucket = self._ring[0]  # a view: add() writes through it
        # The current bucket's pairs per (layer, shard), as Python integers: a numpy scalar update
        # per slice would cost more than the whole expert add (measured: 8x the accounting).
        self._sent = [[0] * num_shards for _ in self.layers]
        self._bucket_s = window_s / BUCKETS
        self._clock = clock
        self._started = self._bucket_start = clock()

    def add(self, slot: int, expert_pairs: np.ndarray, shard_pairs: Iterable[tuple[int, int]]) -> None:
        """slot: the layer's row (self.slots); expert_pairs: [E] int64, the layer call's tokens per expert;
        shard_pairs: (shard, pairs) it sent, the attention node's hot experts as shard W."""
        self._bucket[slot] += expert_pairs
        sent = self._sent[slot]
        for shard, pairs in shard_pairs:
            sent[shard] += pairs

    def _fold(self) -> None:
        """The current bucket's shard counts into its ring."""
        self._shard_ring[self._current] += self._sent
        for sent in self._sent:
            sent[:] = [0] * len(sent)

    def advance(self) -> bool:
        """Move the ring to now; True when a bucket was started."""
        elapsed = int((self._clock() - self._bucket_start) // self._bucket_s)
        if elapsed <= 0:
            return False
        self._fold()
        for _ in range(min(elapsed, BUCKETS)):
            self._current = (self._current + 1) % BUCKETS
            for ring, retired in ((self._ring, self._retired), (self._shard_ring, self._shard_retired)):
                retired += ring[self._current]
                ring[self._current] = 0
        self._bucket = self._ring[self._current]
        self._bucket_start += elapsed * self._bucket_s
        return True

    def view(self) -> LoadView:
        self._fold()
        now = self._clock()
        window, shard_window = self._ring.sum(axis=0), self._shard_ring.sum(axis=0)
        covered = min((BUCKETS - 1) * self._bucket_s + now - self._bucket_start, now - self._started)
        return LoadView(self.layers, tuple(self.shards.tolist()), self.top_k, self.window_s, covered, window,
                        self._retired + window, shard_window, self._shard_retired + shard_window)  # fmt: skip
