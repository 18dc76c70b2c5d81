"""Stage 2: split a layer's (token, expert) pairs by the shard that holds the expert
(protos/placement.py); the transport sends each shard's slice to one of its replicas. An expert
that re-placement split over several shards (attention_server/replace.py) deals its pairs over them.

Runs on the host for every MoE layer of every step, so it works on numpy views of the routing
(a few microseconds per operation, where torch's dispatch costs several times that at decode
sizes) and hands out torch views of the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """The part of a micro-batch one shard's experts compute.

    rows:  [T_s] int64 token indices into the layer input, ascending
    pairs: [3, P_s] int32, the wire's pair block: row index into `rows`, global expert id,
           router weight (float32 bits); read through the properties below
    """

    shard: int
    rows: torch.Tensor
    pairs: torch.Tensor

    @property
    def pair_rows(self) -> torch.Tensor:
        """[P_s] int32 index into `rows`."""
        return self.pairs[0]

    @property
    def pair_experts(self) -> torch.Tensor:
        """[P_s] int32 global expert ids."""
        return self.pairs[1]

    @property
    def pair_weights(self) -> torch.Tensor:
        """[P_s] float32 router weights."""
        return self.pairs[2].view(torch.float32)

    @property
    def num_pairs(self) -> int:
        return self.pairs.shape[1]


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """What each shard computes for one layer; shards without pairs are absent."""

    num_tokens: int
    slices: tuple[ShardSlice, ...]  # ascending shard
    expert_pairs: np.ndarray  # [E] int64, pairs routed to each expert (the load the metrics see)


@dataclass(frozen=True, slots=True)
class Split:
    """The experts of one layer whose pairs are dealt over several shards.

    Expert e's j-th pair since the split began goes to shard slots[e, j % SLOTS]: the slots hold
    each shard as often as its share of e, spread evenly (replace.py), and `turns` carries the count
    from one layer call to the next, so that even one pair per call is dealt in proportion.
    """

    slots: np.ndarray  # [E, SLOTS] int64, the shard of each turn; a row of one shard for an expert not split
    split: np.ndarray  # [E] bool, the experts dealt over more than one shard
    turns: np.ndarray  # [E] int64, pairs dealt so far; advanced by every call (one layer's calls run in order)

    def deal(self, ids: np.ndarray, pair_shards: np.ndarray) -> None:
        """ids: [P] expert of each pair, in token order; sets the split experts' pairs' shards in place."""
        dealt = np.flatnonzero(self.split[ids])
        if not len(dealt):
            return
        experts = ids[dealt]
        by_expert = np.argsort(experts, kind="stable")  # token order kept within an expert
        grouped = experts[by_expert]
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        counts = np.diff(np.r_[starts, len(grouped)])
        rank = np.empty(len(experts), dtype=np.int64)  # j among this call's pairs of the same expert
        rank[by_expert] = np.arange(len(grouped)) - np.repeat(starts, counts)
        turn = self.turns[experts] + rank
        pair_shards[dealt] = self.slots[experts, turn % self.slots.shape[1]]
        self.turns[grouped[starts]] += counts


# Up to this many pairs (decode: a few tokens times top-k) one pass in plain Python over the pairs
# beats the numpy pass below, whose two dozen calls cost a few microseconds each however small
# the arrays: on the development machine 56 against 143 us for one token, top-4 over 8 shards,
# 132 against 183 us for 16 tokens.
SMALL_PAIRS = 64


def partition(topk_ids: torch.Tensor, topk_weights: torch.Tensor, shards: np.ndarray,
              split: Split | None = None) -> DispatchPlan:  # fmt: skip
    """topk_ids, topk_weights: [T, k]; shards: [E] int64, the shard of each expert; split: the
    experts dealt over several shards instead."""
    num_tokens, k = topk_ids.shape
    if split is None and num_tokens * k <= SMALL_PAIRS:
        return _partition_small(topk_ids, topk_weights, shards)
    return _partition_arrays(topk_ids, topk_weights, shards, split)


def _partition_arrays(topk_ids: torch.Tensor, topk_weights: torch.Tensor, shards: np.ndarray,
                      split: Split | None) -> DispatchPlan:  # fmt: skip
    """partition() in numpy calls, whose number does not grow with the pairs."""
    num_tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1).cpu().numpy().astype(np.int32, copy=False)  # [P = T*k]
    weights = topk_weights.reshape(-1).float().cpu().numpy()  # [P]
    pair_shards = shards[ids]  # [P]
    if split is not None:
        split.deal(ids, pair_shards)
    order = np.argsort(pair_shards, kind="stable")  # pairs grouped by shard, token order kept in each
    sorted_ids = ids[order]
    owners = pair_shards[order]  # [P] ascending
    tokens = order // k  # [P] token of each pair
    new_shard = np.empty(len(order), dtype=bool)  # first pair of a shard
    new_shard[0] = True
    np.not_equal(owners[1:], owners[:-1], out=new_shard[1:])
    new_row = new_shard.copy()  # first pair of a (shard, token)
    new_row[1:] |= tokens[1:] != tokens[:-1]
    row_number = np.cumsum(new_row) - 1  # [P] global row count; less its shard's first, its row index
    starts = np.flatnonzero(new_shard)
    row_starts = row_number[starts]
    pairs = np.empty((3, len(order)), dtype=np.int32)
    pairs[0] = row_number - row_starts[np.cumsum(new_shard) - 1]
    pairs[1] = sorted_ids
    pairs[2] = weights[order].view(np.int32)
    rows = tokens[new_row]  # [sum of T_s] each shard's rows, back to back
    bounds, row_bounds = [*starts.tolist(), len(order)], [*row_starts.tolist(), len(rows)]
    return _plan(num_tokens, owners[starts].tolist(), rows, row_bounds, pairs, bounds,
                 np.bincount(ids, minlength=len(shards)))  # fmt: skip


def _partition_small(topk_ids: torch.Tensor, topk_weights: torch.Tensor, shards: np.ndarray) -> DispatchPlan:
    """partition() without a split, pair by pair in Python: the same plan, bit for bit."""
    num_tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1).tolist()  # [P] in token order
    bits = topk_weights.reshape(-1).float().cpu().view(torch.int32).tolist()  # the weights' float32 bits
    shard_of = shards.tolist()
    by_shard: dict[int, list[int]] = {}
    for p, expert in enumerate(ids):
        by_shard.setdefault(shard_of[expert], []).append(p)
    owners = sorted(by_shard)
    row_of_pair, sorted_ids, sorted_bits, rows, bounds, row_bounds = [], [], [], [], [0], [0]
    for shard in owners:
        first_row = len(rows)
        for p in by_shard[shard]:  # token order
            if len(rows) == first_row or rows[-1] != p // k:
                rows.append(p // k)
            row_of_pair.append(len(rows) - 1 - first_row)
            sorted_ids.append(ids[p])
            sorted_bits.append(bits[p])
        bounds.append(len(sorted_ids))
        row_bounds.append(len(rows))
    pairs = np.array([row_of_pair, sorted_ids, sorted_bits], dtype=np.int32)
    return _plan(num_tokens, owners, np.array(rows, dtype=np.int64), row_bounds, pairs, bounds,
                 np.bincount(np.array(ids, dtype=np.int64), minlength=len(shards)))  # fmt: skip


def _plan(num_tokens: int, owners: list[int], rows: np.ndarray, row_bounds: list[int], pairs: np.ndarray,
          bounds: list[int], expert_pairs: np.ndarray) -> DispatchPlan:  # fmt: skip
    """Shard owners[i]'s slice: rows[row_bounds[i]:row_bounds[i + 1]] and pairs[:, bounds[i]:bounds[i + 1]]."""
    slices = tuple(
        ShardSlice(shard, torch.from_numpy(rows[row_bounds[i] : row_bounds[i + 1]]),
                   torch.from_numpy(pairs[:, bounds[i] : bounds[i + 1]].copy()))  # fmt: skip
        for i, shard in enumerate(owners)
    )
    return DispatchPlan(num_tokens=num_tokens, slices=slices, expert_pairs=expert_pairs)
