"""Re-placement: shares of the busiest routed experts move onto the least loaded workers, while serving.

The static placement (protos/placement.py) gives every expert one home shard. Routing is skewed,
so the shard holding a layer's busiest experts sets that layer's pace. From the expert load window
(load/window.py), the attention node plans a layout in which an expert's pairs may be dealt over
several shards: its SLOTS turns are shared out between its home and other shards, each shard's
turns spread evenly, so that the shards' predicted loads come within TARGET of their mean:

    load window, each new bucket ─▶ worst layer's predicted max/mean under the current layout
        > --rebalance-above? ─▶ in the background, plan(): move turns of the busiest experts from
        the busiest shard to the least busy one that may hold another expert (--spare-expert-bytes
        per worker) ─▶ better by IMPROVEMENT? Place(epoch, its extra experts) on every worker, which
        loads them beside what it holds and keeps the previous epoch's ─▶ all answered: ready
        ─▶ the next MoE layer call takes the layout (ExpertPool.route)

A layer call partitions with one layout from send to combine, and the workers still hold the
previous epoch's extras, so nothing in flight is lost at a switch; a new round starts only once
every call of the epoch before the current one is done. A worker that comes back after being down
gets the current extras before it is given work again (the transport's prepare_rejoin). Tokens differ from the
static placement only by the float32 rounding of the workers' partial sums (the parity tie rule).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from attention_server import metrics
from attention_server.config import MAX_MICROBATCHES
from attention_server.partition import Split
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.placement import Placement
from protos.security import Security

logger = logging.getLogger(__name__)

SLOTS = 16  # turns per expert: a share of an expert is a multiple of 1/SLOTS of its pairs
TARGET = 1.05  # a plan moves turns until every layer's busiest shard is within this of the mean
IMPROVEMENT = 0.05  # a new layout is placed only when it lowers the worst layer's balance by this much
PLACE_TIMEOUT_S = 300.0  # a worker loading its extras from disk
QUIET_S = 30.0  # after a plan that could not do better, the load window is left to change this long


class ReplacementError(RuntimeError):
    """A worker did not take a layout."""


def even_slots(turns: np.ndarray) -> np.ndarray:
    """turns: [W] int, summing to SLOTS -> [SLOTS] shard of each turn, each shard's turns spread
    evenly (smooth weighted round robin), so that a few consecutive pairs are already in proportion."""
    current = np.zeros(len(turns), dtype=np.int64)
    out = np.empty(SLOTS, dtype=np.int64)
    for i in range(SLOTS):
        current += turns
        out[i] = int(np.argmax(current))  # ties: the lower shard
        current[out[i]] -= SLOTS
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """One placement epoch of the workers' experts.

    shares[layer]: [E, W] turns (of SLOTS) of each expert on each shard; a layer absent is static.
    extras[w]: the experts worker w holds beside its shards, per MoE layer.
    """

    epoch: int
    shares: dict[int, np.ndarray]
    extras: tuple[dict[int, tuple[int, ...]], ...]
    routes: dict[int, tuple[np.ndarray, Split | None]]  # per layer: [E] shard, and the split experts' deal

    @classmethod
    def make(cls, epoch: int, shares: dict[int, np.ndarray], placement: Placement) -> Layout:
        home = placement.shard_table()
        extras: list[dict[int, set[int]]] = [{} for _ in range(placement.num_workers)]
        static = [placement.worker_experts(w) for w in range(placement.num_workers)]
        routes = {}
        for layer, turns in shares.items():
            slots = np.stack([even_slots(row) for row in turns])  # [E, SLOTS]
            split = (turns > 0).sum(axis=1) > 1
            routes[layer] = (slots[:, 0].copy(), Split(slots, split, np.zeros(len(turns), dtype=np.int64))
                             if split.any() else None)  # fmt: skip
            for expert, shard in zip(*np.nonzero(turns)):
                if shard != home[expert]:
                    for worker in placement.replica_workers(int(shard)):
                        if int(expert) not in static[worker]:
                            extras[worker].setdefault(layer, set()).add(int(expert))
        held = tuple({layer: tuple(sorted(ids)) for layer, ids in sorted(w.items())} for w in extras)
        return cls(epoch, shares, held, routes)

    @property
    def moved(self) -> int:
        """(layer, expert, shard)s holding turns of an expert away from its home shard."""
        return sum(int((turns > 0).sum()) - len(turns) for turns in self.shares.values())

    def route(self, layer: int, home: np.ndarray) -> tuple[np.ndarray, Split | None]:
        return self.routes.get(layer, (home, None))

    def loads(self, counts: np.ndarray, layers: tuple[int, ...], home: np.ndarray, num_shards: int) -> np.ndarray:
        """counts: [L, E] pairs -> [L, W] the pairs each shard would compute under this layout."""
        static = np.zeros((len(home), num_shards), dtype=np.int64)
        static[np.arange(len(home)), home] = SLOTS
        return np.stack([row @ self.shares.get(layer, static) / SLOTS for layer, row in zip(layers, counts)])


STATIC = Layout(0, {}, (), {})


def worst_balance(loads: np.ndarray) -> float:
    """[L, W] -> the largest max/mean over the layers that routed anything (1.0 when none did)."""
    mean = loads.mean(axis=1)
    busy = mean > 0
    return float((loads[busy].max(axis=1) / mean[busy]).max()) if busy.any() else 1.0


def plan(counts: np.ndarray, layers: tuple[int, ...], placement: Placement, spare_experts: int) -> dict[int, np.ndarray]:
    """counts: [L, E] pairs per (layer, expert) to balance (the attention node's hot experts left out)
    -> shares per layer that moved anything ([E, W] turns). Greedy, worst layer first (so that the
    spare memory goes where the balance is worst): while that layer's busiest shard is above
    TARGET x the mean, move as many turns of its busiest expert as fit below the mean of the least
    busy shard that may take it (every worker holding that shard has a spare expert left, or
    already holds it); one turn when no more fit, if that still lowers the pair's maximum."""
    home = placement.shard_table()
    num_experts, num_shards = len(home), placement.num_workers
    static_turns = np.zeros((num_experts, num_shards), dtype=np.int64)
    static_turns[np.arange(num_experts), home] = SLOTS
    static = [placement.worker_experts(w) for w in range(num_shards)]
    spare = [spare_experts] * num_shards  # per worker, over all layers
    units = counts.astype(np.float64) / SLOTS  # [L, E] pairs per turn
    turns = [static_turns.copy() for _ in layers]
    loads = [unit @ static_turns for unit in units]
    held = [[set(experts) for experts in static] for _ in layers]  # per layer: the shards', then the extras
    open_layers = {i for i, load in enumerate(loads) if load.mean() > 0}
    for _ in range(len(layers) * num_experts * num_shards):
        worst = max(open_layers, key=lambda i: (loads[i].max() / loads[i].mean(), -i), default=None)
        if worst is None:
            break
        load = loads[worst]
        if load.max() <= TARGET * load.mean() or not _move(turns[worst], load, units[worst], load.mean(),
                                                            held[worst], spare, placement):  # fmt: skip
            open_layers.discard(worst)
    return {layer: t for layer, t in zip(layers, turns) if (t != static_turns).any()}


def _move(turns, load, unit, mean, held, spare, placement: Placement) -> bool:
    source = int(np.argmax(load))
    for dest in np.argsort(load, kind="stable").tolist():
        if dest == source:
            continue
        for expert in np.argsort(-unit * (turns[:, source] > 0), kind="stable").tolist():
            if turns[expert, source] == 0 or unit[expert] == 0:
                break
            k = int(min(load[source] - mean, mean - load[dest]) // unit[expert])
            if k == 0 and load[dest] + unit[expert] < load[source] - unit[expert]:
                k = 1
            k = min(k, int(turns[expert, source]))
            workers = placement.replica_workers(dest)
            if k <= 0 or any(expert not in held[w] and spare[w] == 0 for w in workers):
                continue
            for w in workers:
                if expert not in held[w]:
                    held[w].add(expert)
                    spare[w] -= 1
            turns[expert, source] -= k
            turns[expert, dest] += k
            load[source] -= k * unit[expert]
            load[dest] += k * unit[expert]
            return True
    return False


class Replacer:
    """The workers' current layout, re-planned from the load window and placed in the background."""

    def __init__(self, placement: Placement, endpoints: tuple[str, ...], security: Security, spare_bytes: int,
                 expert_bytes: int, rebalance_above: float, workers_down: Callable[[], bool],
                 on_take: Callable[[], None], workers_epoch: int):  # fmt: skip
        self.placement, self.endpoints, self.security = placement, endpoints, security
        self.home = placement.shard_table()
        self.spare_experts = spare_bytes // expert_bytes
        if self.spare_experts < 1:
            raise ValueError(f"--spare-expert-bytes {spare_bytes} holds no expert: one takes {expert_bytes} bytes")
        self.rebalance_above, self.workers_down, self.on_take = rebalance_above, workers_down, on_take
        self._current, self._ready = STATIC, None
        # The last epoch sent to a worker: epochs only grow on a worker, which may have served an
        # attention node before this one (workers_epoch: the highest their Info reported).
        self._epochs = workers_epoch
        self._placing = False
        self._calls_since_take = MAX_MICROBATCHES + 1  # steps (of each micro-batch) ended since the last take
        self._quiet_until = 0.0  # no planning before (time.monotonic()): the last plan could not do better
        self._lock = threading.Lock()  # the fields above
        self._place_lock = threading.Lock()  # one Place round (or a rejoined worker's) at a time

    def current(self) -> Layout:
        """The layout for a layer call starting now (a placed one is taken here: its epoch starts)."""
        if self._ready is not None:
            with self._lock:
                ready, self._ready = self._ready, None
                self._current, self._calls_since_take = ready, 0
            self.on_take()
            metrics.REPLACED_EXPERTS.set(ready.moved)
            logger.info("expert layout, epoch %d: %d expert share(s) away from home; extras per worker %s",
                        ready.epoch, ready.moved, [sum(map(len, w.values())) for w in ready.extras])  # fmt: skip
        return self._current

    def step_done(self) -> None:
        self._calls_since_take += 1

    def offer(self, window: np.ndarray, layers: tuple[int, ...], hot: dict[int, tuple[int, ...]]) -> None:
        """A new bucket of the load window ([L, E] pairs): when a layer's predicted balance (hot
        experts left out) is above --rebalance-above, plan and place in the background."""
        with self._lock:
            # A round drops the extras of the layout before the current one: no call may still use them.
            if (self._placing or self._ready is not None or self._calls_since_take <= MAX_MICROBATCHES
                    or time.monotonic() < self._quiet_until):  # fmt: skip
                return
            current = self._current
        if self.workers_down():
            return
        counts = window.copy()
        for i, layer in enumerate(layers):
            counts[i, list(hot.get(layer, ()))] = 0
        now = worst_balance(current.loads(counts, layers, self.home, self.placement.num_workers))
        if now <= self.rebalance_above:
            return
        with self._lock:
            self._placing = True
        threading.Thread(target=self._place, args=(counts, layers, now), name="hetero-moe-replace", daemon=True).start()

    def _place(self, counts: np.ndarray, layers: tuple[int, ...], now: float) -> None:
        """Plan from `counts`; place the plan when it beats the current layout's `now`."""
        try:
            shares = plan(counts, layers, self.placement, self.spare_experts)
            # The plan's balance needs its shares only (Layout.make's deal and extras come once, when placed).
            better = worst_balance(Layout(0, shares, (), {}).loads(counts, layers, self.home, self.placement.num_workers))
            if better > now - IMPROVEMENT:
                logger.info("expert layout: worst layer balance %.2f over the window, and no layout within the "
                            "spare memory does better than %.2f; next look in %g s", now, better, QUIET_S)  # fmt: skip
                self._quiet_until = time.monotonic() + QUIET_S
                return
            logger.info("expert layout: worst layer balance %.2f over the window; placing one at %.2f", now, better)
            self._place_round(shares)
        except Exception:
            logger.exception("expert layout: placing failed")
        finally:
            with self._lock:
                self._placing = False

    def _place_round(self, shares: dict[int, np.ndarray]) -> None:
        with self._place_lock:
            self._epochs += 1
            layout = Layout.make(self._epochs, shares, self.placement)
            placed = []
            try:
                for worker in range(self.placement.num_workers):
                    self._send(worker, layout)
                    placed.append(worker)
            except ReplacementError as err:
                # The workers that took it would drop the current layout's extras at their next
                # round: give them the current extras again, as a newer epoch, and keep the current.
                logger.error("expert layout, epoch %d: %s; keeping epoch %d", layout.epoch, err, self._current.epoch)
                self._epochs += 1
                for worker in placed:
                    self._send(worker, dataclasses.replace(self._current, epoch=self._epochs), quiet=True)
                return
            self._ready = layout  # under the place lock: a rejoining worker gets it too (restore)

    def restore(self, worker: int) -> None:
        """Before a worker that was down gets work again: the extras of the current layout (and of
        one placed but not yet taken). Raises ReplacementError when it does not take them."""
        with self._place_lock:
            for layout in (self._current, self._ready):
                if layout is not None and layout.extras:
                    self._epochs += 1
                    self._send(worker, dataclasses.replace(layout, epoch=self._epochs))

    def _send(self, worker: int, layout: Layout, quiet: bool = False) -> None:
        extras = layout.extras[worker] if layout.extras else {}
        request = pb.PlaceRequest(epoch=layout.epoch, layers=[pb.LayerExperts(layer=layer, experts=ids)
                                                              for layer, ids in extras.items()])  # fmt: skip
        endpoint = self.endpoints[worker]
        try:
            with self.security.channel(endpoint) as channel:
                pb_grpc.ExpertServiceStub(channel).Place(request, timeout=PLACE_TIMEOUT_S)
        except grpc.RpcError as err:
            if not quiet:
                raise ReplacementError(f"worker {worker} at {endpoint}: Place: {err.code().name}: {err.details()}") from None
            logger.warning("worker %d at %s: Place: %s: %s", worker, endpoint, err.code().name, err.details())

