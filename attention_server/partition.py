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


def partition(topk_ids: torch.Tensor, topk_weights: torch.Tensor, shards: np.ndarray,
              split: Split | None = None) -> DispatchPlan:  # fmt: skip
    """topk_ids, topk_weights: [T, k]; shards: [E] int64, the shard of each expert; split: the
    experts dealt over several shards instead."""
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
    slices = tuple(
        ShardSlice(shard, torch.from_numpy(rows[row_bounds[i] : row_bounds[i + 1]]),
                   torch.from_numpy(pairs[:, bounds[i] : bounds[i + 1]].copy()))  # fmt: skip
        for i, shard in enumerate(owners[starts].tolist())
    )
    return DispatchPlan(num_tokens=num_tokens, slices=slices, expert_pairs=np.bincount(ids, minlength=len(shards)))
