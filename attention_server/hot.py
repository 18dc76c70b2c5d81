"""Hot experts on the attention node: the routed experts that take the most tokens, within a byte
budget (--hot-expert-bytes), computed here while the layer's remote work is in flight, with the
kernels the workers use, loaded the way they loaded theirs.

    expert load window (load/window.py), each new bucket ─▶ choose(): the busiest (layer, expert)s
        that fit the budget ─▶ a different set? a loader thread reads their tensors (load_experts)
        ─▶ ready ─▶ the next layer call takes it: placement epoch + 1

A layer call partitions its pairs with a shard table in which a hot expert belongs to shard W,
past the workers' 0 … W-1 (ExpertPool.route): that slice is never sent, it is computed here, and
combine adds it last, in float64, as it adds every shard in order. A set is taken whole at the start of a
layer call (send) and used by its receive, so a switch never splits a layer's work; the old set's
weights go when the last call holding it is done. Tokens differ from an all-remote layer only by
the float32 rounding of a shard's partial sum (the parity tests' tie rule).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attention_server import metrics
from attention_server.load.window import LoadView
from attention_server.partition import ShardSlice
from expert_server.weights import LoadedShard, load_experts, loaded_expert_bytes
from protos import expert_pb2 as pb
from protos.checkpoint import MoeCheckpoint

logger = logging.getLogger(__name__)


class HotExpertsError(ValueError):
    """Hot experts that the attention node cannot compute as the workers do."""


@dataclass(frozen=True, slots=True)
class WorkerFormat:
    """How the workers loaded their experts (their Info), which hot experts must repeat."""

    load_format: str  # "checkpoint" or "w4a16"
    group_size: int
    kernel_backend: str
    weight_format: str  # the workers' description, which a hot set's must equal

    @classmethod
    def of(cls, infos: Sequence[pb.InfoResponse]) -> WorkerFormat:
        formats = {cls(i.load_format or "checkpoint", i.group_size or 128, i.kernel_backend, i.weight_format)
                   for i in infos}  # fmt: skip
        if len(formats) != 1:
            raise HotExpertsError(f"hot experts need every worker to load its experts alike; they differ: {formats}")
        return formats.pop()


@dataclass(frozen=True, slots=True)
class HotSet:
    """One placement epoch's hot experts."""

    epoch: int
    experts: dict[int, tuple[int, ...]]  # MoE layer -> hot global expert ids, ascending; absent: none
    local: dict[int, np.ndarray]  # MoE layer -> [E] index among the layer's hot experts (-1: not hot)
    loaded: LoadedShard | None
    nbytes: int

    def compute(self, layer: int, x: torch.Tensor, part: ShardSlice) -> torch.Tensor:
        """[T_s, H] float32: the hot slice's router-weighted expert sum, as a worker computes its shard's."""
        experts = self.loaded.layers[layer]
        local = torch.from_numpy(self.local[layer][part.pair_experts.numpy()])
        return experts(x[part.rows.to(x.device)], part.pair_rows.long().to(x.device), local.to(x.device),
                       part.pair_weights.to(x.device), rows_ascending=True)  # fmt: skip


def choose(window: np.ndarray, layers: Sequence[int], budget_bytes: int, expert_bytes: int) -> dict[int, tuple[int, ...]]:
    """The busiest (layer, expert)s of `window` ([L, E] pairs) that fit `budget_bytes`, each costing
    `expert_bytes`; only experts that took tokens; ties go to the lower layer, then expert."""
    n = min(budget_bytes // expert_bytes, int(np.count_nonzero(window)))
    if n <= 0:
        return {}
    flat = window.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))[:n]  # by pairs descending, then position
    picked: dict[int, list[int]] = {}
    for index in sorted(order.tolist()):
        row, expert = divmod(index, window.shape[1])
        picked.setdefault(layers[row], []).append(expert)
    return {layer: tuple(ids) for layer, ids in picked.items()}


class HotExperts:
    """The attention node's hot set, re-chosen from the load window and switched in between calls."""

    def __init__(self, ckpt: MoeCheckpoint, budget_bytes: int, workers: WorkerFormat, device: torch.device,
                 on_take: Callable[[], None]):  # fmt: skip
        self.ckpt, self.budget_bytes, self.workers, self.device = ckpt, budget_bytes, workers, device
        self.on_take = on_take  # a placement epoch starts
        self.expert_bytes = expert_bytes(ckpt, workers)
        if budget_bytes < self.expert_bytes:
            raise HotExpertsError(f"--hot-expert-bytes {budget_bytes} holds no expert: one takes {self.expert_bytes} bytes")
        self._current = HotSet(0, {}, {}, None, 0)
        self._ready: HotSet | None = None
        self._loading = False
        self._lock = threading.Lock()
        # Fail now, not on the first switch, when this node cannot compute experts as the workers do.
        first = ckpt.moe_layers[0]
        self._load({first: (0,)})

    def current(self) -> HotSet:
        """The set for a layer call starting now (a loaded one is taken here: its epoch starts)."""
        if self._ready is not None:
            with self._lock:
                ready, self._ready = self._ready, None
                self._current = ready
            self.on_take()
            metrics.publish_hot(sum(len(e) for e in ready.experts.values()), ready.nbytes)
            logger.info("hot experts, epoch %d: %s (%.1f MiB)", ready.epoch, _describe(ready.experts), ready.nbytes / 2**20)
        return self._current

    def offer(self, view: LoadView) -> None:
        """A new bucket of the load window: load the set it asks for, in the background, if it differs."""
        wanted = choose(view.window, view.layers, self.budget_bytes, self.expert_bytes)
        with self._lock:
            pending = self._ready or self._current
            if self._loading or not wanted or wanted == pending.experts:
                return
            self._loading = True
        threading.Thread(target=self._prepare, args=(wanted, pending.epoch + 1), name="hetero-moe-hot-experts",
                         daemon=True).start()  # fmt: skip

    def _prepare(self, wanted: dict[int, tuple[int, ...]], epoch: int) -> None:
        try:
            loaded = self._load(wanted)
            local = {}
            for layer, ids in wanted.items():
                local[layer] = np.full(self.ckpt.num_experts, -1, dtype=np.int64)
                local[layer][list(ids)] = np.arange(len(ids))
            self._ready = HotSet(epoch, wanted, local, loaded, self.expert_bytes * sum(map(len, wanted.values())))
        except Exception:  # the current set stays; the next bucket tries again
            logger.exception("hot experts: loading %s failed; keeping epoch %d", _describe(wanted), epoch - 1)
        finally:
            with self._lock:
                self._loading = False

    def _load(self, experts: dict[int, tuple[int, ...]]) -> LoadedShard:
        w = self.workers
        loaded = load_experts(self.ckpt, experts, self.device, w.load_format, w.kernel_backend, w.group_size)
        if (loaded.weight_format, loaded.kernel_backend) != (w.weight_format, w.kernel_backend):
            raise HotExpertsError(
                f"hot experts load here as {loaded.weight_format!r} on {loaded.kernel_backend!r}, the workers' as "
                f"{w.weight_format!r} on {w.kernel_backend!r}: the tokens would differ"
            )
        return loaded


def expert_bytes(ckpt: MoeCheckpoint, workers: WorkerFormat) -> int:
    """One routed expert's weights as the workers loaded theirs."""
    return loaded_expert_bytes(ckpt, workers.load_format, workers.group_size)


def _describe(experts: dict[int, tuple[int, ...]]) -> str:
    return "; ".join(f"layer {layer}: {list(ids)}" for layer, ids in experts.items()) or "none"
