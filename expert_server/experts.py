"""This worker's experts, validated requests in, float32 partials out.

A worker holds its static shards (protos/placement.py) and, after a Place, extra experts beside
them (expert_server/extras.py), each extra its own PreparedExperts. Every held set is a range of
expert ids (a shard's, or one extra's), and per MoE layer a table says which set computes each:

    sets:   shard 0 .. shard S-1 (ascending), then the extras of the current and previous epoch
            (ascending expert id)
    set_of: [E] int64 index into sets, -1 for an expert not held
    offset: [sets] int64 the first expert id of each set: an expert's index in its set is id - offset

    request (layer, pairs) --set_of[experts]--> pairs grouped by set, in set order
        --each set's PreparedExperts--> [T, H] float32 partial per set --summed in set order--> partial

Sets being ranges, a request whose lowest and highest expert lie in one set lies in it whole: the
common case (every request of a static placement) costs two lookups and one call, as before
extras existed, and gives the same bits.
"""
from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from expert_server.native import FrameTables
from expert_server.weights import LoadedShard
from kernels.backends.base import PreparedExperts
from protos.checkpoint import MoeCheckpoint
from protos.frames import Header

HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _address(buffer: memoryview) -> int:
    """Where a writable, contiguous buffer's bytes are (for a C call that reads or writes them)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class RequestError(ValueError):
    """A request that is malformed or asks for something this worker does not hold."""


@dataclass(frozen=True, slots=True)
class PairGroup:
    """The pairs of a request that one held set computes.

    pair_rows:    [P_g] int64 in [0, T)
    pair_experts: [P_g] int64 expert index within the set
    pair_weights: [P_g] float32
    rows_ascending: pair_rows never decrease (the attention node sends pairs in token order)
    """

    experts: PreparedExperts
    pair_rows: torch.Tensor
    pair_experts: torch.Tensor
    pair_weights: torch.Tensor
    rows_ascending: bool


@dataclass(frozen=True, slots=True)
class ExpertBatch:
    """One validated Forward request: hidden [T, H] float, its pairs grouped by held set in the
    order their partials are summed (static shards ascending, then extras by expert id)."""

    layer: int
    hidden: torch.Tensor
    groups: tuple[PairGroup, ...]  # at least one (an empty request computes zeros on its first set)
    num_pairs: int


@dataclass(frozen=True, slots=True)
class HeldShard:
    """Experts [start, end) of every MoE layer, loaded."""

    start: int
    end: int
    loaded: LoadedShard


@dataclass(frozen=True, slots=True)
class LayerTable:
    """One MoE layer's held sets and the tables that find an expert's (module docstring)."""

    sets: tuple[PreparedExperts, ...]
    set_of: np.ndarray  # [E] int64, -1: not held
    offset: np.ndarray  # [len(sets)] int64
    extras: tuple[int, ...]  # the extra experts, ascending (sets[S:] in this order)


class LocalExperts:
    """The shards of one checkpoint this worker holds (protos/placement.py) and the extras a Place
    added beside them; a request may name any of them."""

    def __init__(self, ckpt: MoeCheckpoint, shards: list[HeldShard], device: torch.device):
        assert shards, "a worker holds at least one shard"
        self.ckpt = ckpt
        self.shards = sorted(shards, key=lambda s: s.start)
        self.device = device
        first = self.shards[0].loaded
        self.layers = tuple(first.layers)
        self.kernel_backend, self.weight_format = first.kernel_backend, first.weight_format
        self.load_format, self.group_size = first.load_format, first.group_size
        # The tables as the shared-memory plane's C loop reads them, when a set computes frames in C.
        self.frames: FrameTables | None = None
        self._tables = self._build({})

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.shards]

    def static(self, expert: int) -> bool:
        """Whether one of this worker's shards holds `expert`."""
        return any(s.start <= expert < s.end for s in self.shards)

    def hold(self, extras: Mapping[tuple[int, int], PreparedExperts]) -> None:
        """Serve exactly these extras beside the shards from the next request on: {(layer, expert):
        that one expert's PreparedExperts}, none of them in a shard. The caller keeps a computation
        from running meanwhile (ExpertHandler.hold); a request validated before still computes with
        the sets it found."""
        assert not any(self.static(e) for _, e in extras), "an extra expert of a static shard"
        self._tables = self._build(extras)

    def _build(self, extras: Mapping[tuple[int, int], PreparedExperts]) -> dict[int, LayerTable]:
        tables = {}
        for layer in self.layers:
            set_of = np.full(self.ckpt.num_experts, -1, dtype=np.int64)
            for i, s in enumerate(self.shards):
                set_of[s.start : s.end] = i
            ids = tuple(sorted(e for l, e in extras if l == layer))
            set_of[list(ids)] = np.arange(len(self.shards), len(self.shards) + len(ids))
            sets = tuple(s.loaded.layers[layer] for s in self.shards) + tuple(extras[layer, e] for e in ids)
            offset = np.array([s.start for s in self.shards] + list(ids), dtype=np.int64)
            tables[layer] = LayerTable(sets, set_of, offset, ids)
        if self.frames is None and any(s.frame_kernel() is not None for t in tables.values() for s in t.sets):
            self.frames = FrameTables(self.ckpt.hidden_size, self.ckpt.num_experts)
        if self.frames is not None:
            self.frames.set({layer: (t.sets, t.set_of, t.offset) for layer, t in tables.items()})
        return tables

    def make_batch(
        self,
        layer: int,
        hidden: torch.Tensor,
        pair_rows: torch.Tensor,
        pair_experts: torch.Tensor,
        pair_weights: torch.Tensor,
    ) -> ExpertBatch:
        """Check a decoded request against what this worker holds."""
        table = self._tables.get(layer)  # one snapshot: a Place switching meanwhile does not split a request
        if table is None:
            raise RequestError(f"layer {layer} is not a MoE layer of this model (MoE layers: {list(self.layers)})")
        if hidden.dtype not in HIDDEN_DTYPES:
            raise RequestError(f"hidden dtype {hidden.dtype} is not one of {HIDDEN_DTYPES}")
        if hidden.dim() != 2 or hidden.shape[1] != self.ckpt.hidden_size:
            raise RequestError(f"hidden must be [T, {self.ckpt.hidden_size}], got {list(hidden.shape)}")
        for name, t, dtype in (
            ("pair_rows", pair_rows, torch.int32),
            ("pair_experts", pair_experts, torch.int32),
            ("pair_weights", pair_weights, torch.float32),
        ):
            if t.dtype != dtype or t.dim() != 1:
                raise RequestError(f"{name} must be a 1-D {dtype} tensor, got {t.dtype} {list(t.shape)}")
        num_pairs = pair_rows.shape[0]
        if pair_experts.shape[0] != num_pairs or pair_weights.shape[0] != num_pairs:
            raise RequestError(
                f"pair tensors differ in length: rows {num_pairs}, experts {pair_experts.shape[0]}, "
                f"weights {pair_weights.shape[0]}"
            )
        # The pair checks run on numpy views, through the ufuncs themselves: per request, torch's
        # dispatch (or numpy's Python wrappers) would cost more than the checks.
        rows, experts = pair_rows.numpy().astype(np.int64), pair_experts.numpy().astype(np.int64)
        first = last = 0
        ascending = bool(np.greater_equal(rows[1:], rows[:-1]).all())  # token order, as the attention node sends
        if num_pairs:
            low, high = np.minimum.reduce(rows), np.maximum.reduce(rows)
            if low < 0 or high >= hidden.shape[0]:
                raise RequestError(f"pair_rows must lie in [0, {hidden.shape[0]}), got [{low}, {high}]")
            low, high = np.minimum.reduce(experts), np.maximum.reduce(experts)
            if low < 0 or high >= self.ckpt.num_experts:
                raise RequestError(f"pair_experts must lie in [0, {self.ckpt.num_experts}), got [{low}, {high}]")
            first, last = table.set_of[low], table.set_of[high]
            if first != last or first < 0:  # several sets, or an expert not held: per-pair lookup
                sets = table.set_of.take(experts)  # [P]
                first, last = np.minimum.reduce(sets), np.maximum.reduce(sets)
                if first < 0:
                    raise RequestError(f"layer {layer}: experts {np.unique(experts[sets < 0]).tolist()} are not "
                                       f"held by this worker; it holds {self.describe(table)}")  # fmt: skip
            keys = rows * self.ckpt.num_experts + experts
            keys.sort()
            if num_pairs > 1 and np.equal(keys[1:], keys[:-1]).any():
                raise RequestError("a (row, expert) pair appears more than once")
        if first == last:
            groups = (PairGroup(table.sets[first], torch.from_numpy(rows).to(self.device),
                                torch.from_numpy(experts - table.offset[first]).to(self.device),
                                pair_weights.to(self.device), ascending),)  # fmt: skip
        else:
            groups = self._grouped(table, sets, rows, experts - table.offset.take(sets), pair_weights.numpy(),
                                   ascending)
        return ExpertBatch(layer=layer, hidden=hidden.to(self.device), groups=groups, num_pairs=num_pairs)

    def forward_frame(self, header: Header, payload: memoryview, out: memoryview) -> bool:
        """The common request computed straight from its FORWARD frame (header checked, `payload`
        writable) into `out`, its reply's [rows, hidden] float32 payload: every pair in one held
        set whose experts take frames (PreparedExperts.forward_frame), with the bits make_batch +
        forward give. False, computing nothing, for any other request: those two then take it,
        and refuse it naming what is wrong."""
        table = self._tables.get(header.layer)
        if table is None or header.hidden != self.ckpt.hidden_size or not header.rows or not header.pairs:
            return False
        at = header.payload - 8 * header.pairs  # the first expert id: after the rows and the pairs' rows
        expert = int.from_bytes(payload[at : at + 4], "little", signed=True)
        if not 0 <= expert < self.ckpt.num_experts or (held := table.set_of[expert]) < 0:
            return False
        return table.sets[held].forward_frame(_address(payload), header.dtype, header.rows, header.pairs,
                                              int(table.offset[held]), _address(out))  # fmt: skip

    def _grouped(self, table: LayerTable, sets: np.ndarray, rows: np.ndarray, local: np.ndarray,
                 weights: np.ndarray, ascending: bool) -> tuple[PairGroup, ...]:  # fmt: skip
        """The pairs of several sets, one group per set in set order (pairs keep their order within, so
        rows that ascend still do)."""
        order = np.argsort(sets, kind="stable")
        starts = np.flatnonzero(np.diff(sets[order])) + 1
        groups = []
        for pairs in np.split(order, starts):
            groups.append(PairGroup(table.sets[sets[pairs[0]]], torch.from_numpy(rows[pairs]).to(self.device),
                                    torch.from_numpy(local[pairs]).to(self.device),
                                    torch.from_numpy(weights[pairs]).to(self.device), ascending))  # fmt: skip
        return tuple(groups)

    def describe(self, table: LayerTable) -> str:
        shards = ", ".join(f"[{s.start}, {s.end})" for s in self.shards)
        return f"{shards} and extras {list(table.extras)}" if table.extras else f"{shards} and no extras"

    def forward(self, batch: ExpertBatch) -> torch.Tensor:
        """[T, H] float32 partial: router-weighted sum of the named experts per row, each group on
        its set's experts; the groups' partials are added in the batch's order, in float32."""
        first, *rest = batch.groups
        partial = first.experts(batch.hidden, first.pair_rows, first.pair_experts, first.pair_weights,
                                rows_ascending=first.rows_ascending)
        for g in rest:
            partial = partial + g.experts(batch.hidden, g.pair_rows, g.pair_experts, g.pair_weights,
                                          rows_ascending=g.rows_ascending)
        return partial.cpu()
