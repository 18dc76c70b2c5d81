"""Stage 2: split a layer's (token, expert) pairs by the worker that owns the expert."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class WorkerSlice:
    """The part of a micro-batch one worker computes.

    rows:         [T_w] int64 token indices into the layer input, ascending
    pair_rows:    [P_w] int32 index into `rows`
    pair_experts: [P_w] int32 global expert ids
    pair_weights: [P_w] float32 router weights
    """

    worker: int
    rows: torch.Tensor
    pair_rows: torch.Tensor
    pair_experts: torch.Tensor
    pair_weights: torch.Tensor


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Who computes what for one layer; workers without pairs are absent."""

    num_tokens: int
    slices: tuple[WorkerSlice, ...]  # ascending worker index


def partition(topk_ids: torch.Tensor, topk_weights: torch.Tensor, owners: torch.Tensor) -> DispatchPlan:
    """topk_ids, topk_weights: [T, k]; owners: [E] owning worker per expert."""
    num_tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long().cpu()  # [T*k]
    weights = topk_weights.reshape(-1).float().cpu()  # [T*k]
    tokens = torch.arange(num_tokens).repeat_interleave(k)  # [T*k]
    worker_of_pair = owners[ids]  # [T*k]
    slices = []
    for worker in torch.unique(worker_of_pair).tolist():
        mask = worker_of_pair == worker
        rows, pair_rows = torch.unique(tokens[mask], return_inverse=True)
        slices.append(
            WorkerSlice(
                worker=worker,
                rows=rows,
                pair_rows=pair_rows.to(torch.int32),
                pair_experts=ids[mask].to(torch.int32),
                pair_weights=weights[mask],
            )
        )
    return DispatchPlan(num_tokens=num_tokens, slices=tuple(slices))
