"""Stage 2: split a layer's (token, expert) pairs by the shard that holds the expert
(protos/placement.py); the transport sends each shard's slice to one of its replicas. An expert
that re-placement split over several shards (attention_server/replace.py) deals its pairs over them.

Runs on the host for every MoE layer of every step: a few numpy calls on the routing and one C
call group the pairs, and the slices are torch views of the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import native_build


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """The part of a micro-batch one shard's experts compute.

    rows:  [T_s] int64 token indices into the layer input, ascending
    pairs: [3, P_s] int32, the wire's pair block: row index into `rows`, global expert id,
           router weight (float32 bits), in token order (row indices never decrease); read through
           the properties below
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
              split: Split | None = None, num_shards: int | None = None) -> DispatchPlan:  # fmt: skip
    """topk_ids, topk_weights: [T, k]; shards: [E] int64, the shard of each expert; split: the
    experts dealt over several shards instead; num_shards: more than any shard (default: the largest
    one's + 1; the attention node passes its own count, which saves a search every layer). The
    grouping is one call of the host library (kernels/csrc/stages.c, hm_partition); each slice's rows
    and pair block are views of its output."""
    num_tokens, k = topk_ids.shape
    ids = _host(topk_ids, torch.int32)  # [T, k], read as [P = T*k] pairs, token-major
    weights = _host(topk_weights, torch.float32)
    num_pairs, num_experts = num_tokens * k, len(shards)
    if shards.dtype != np.int64 or not shards.flags.c_contiguous:
        shards = np.ascontiguousarray(shards, dtype=np.int64)
    pair_shards = None
    if split is not None:
        ids_array = ids.reshape(-1).numpy()
        pair_shards = shards[ids_array]
        split.deal(ids_array, pair_shards)
    if num_shards is None:
        num_shards = int(shards.max() if pair_shards is None else pair_shards.max(initial=0)) + 1
    # One buffer for the int64 results: rows [P], bounds and row_bounds [S + 1] each, expert_pairs [E].
    out = np.empty(num_pairs + 2 * (num_shards + 1) + num_experts, dtype=np.int64)
    rows, bounds = out[:num_pairs], out[num_pairs : num_pairs + num_shards + 1]
    row_bounds, expert_pairs = out[num_pairs + num_shards + 1 : -num_experts], out[-num_experts:]
    blocks = np.empty(3 * num_pairs, dtype=np.int32)
    base = _address(out)
    status = native_build.host_library().hm_partition(
        ids.data_ptr(), weights.data_ptr(), num_pairs, k, _address(shards), num_experts,
        None if pair_shards is None else _address(pair_shards), num_shards, base, _address(blocks),
        base + 8 * num_pairs, base + 8 * (num_pairs + num_shards + 1), base + 8 * (out.shape[0] - num_experts))  # fmt: skip
    if status != 0:
        raise ValueError(f"a routed expert id outside [0, {num_experts}) or a shard outside [0, {num_shards})")
    bounds, row_bounds = bounds.tolist(), row_bounds.tolist()
    slices = tuple(
        ShardSlice(shard, torch.from_numpy(rows[row_bounds[shard] : row_bounds[shard + 1]]),
                   torch.from_numpy(blocks[3 * bounds[shard] : 3 * bounds[shard + 1]].reshape(3, -1)))  # fmt: skip
        for shard in range(num_shards) if bounds[shard + 1] > bounds[shard]
    )
    return DispatchPlan(num_tokens, slices, expert_pairs)


def _host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as a contiguous host tensor of `dtype`; vLLM's CPU router already gives int32 ids and
    float32 weights, which then pass as they are (a torch conversion costs microseconds even when it
    copies nothing)."""
    if tensor.dtype == dtype and tensor.is_contiguous() and tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", dtype).contiguous()


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]
