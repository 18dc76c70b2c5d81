"""Stage 2: split a layer's (token, expert) pairs by the worker that owns the expert.

Runs on the host for every MoE layer of every step, so it works on numpy views of the routing
(a few microseconds per operation, where torch's dispatch costs several times that at decode
sizes) and hands out torch views of the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class WorkerSlice:
    """The part of a micro-batch one worker computes.

    rows:  [T_w] int64 token indices into the layer input, ascending
    pairs: [3, P_w] int32, the wire's pair block: row index into `rows`, global expert id,
           router weight (float32 bits); read through the properties below
    """

    worker: int
    rows: torch.Tensor
    pairs: torch.Tensor

    @property
    def pair_rows(self) -> torch.Tensor:
        """[P_w] int32 index into `rows`."""
        return self.pairs[0]

    @property
    def pair_experts(self) -> torch.Tensor:
        """[P_w] int32 global expert ids."""
        return self.pairs[1]

    @property
    def pair_weights(self) -> torch.Tensor:
        """[P_w] float32 router weights."""
        return self.pairs[2].view(torch.float32)

    @property
    def num_pairs(self) -> int:
        return self.pairs.shape[1]


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Who computes what for one layer; workers without pairs are absent."""

    num_tokens: int
    slices: tuple[WorkerSlice, ...]  # ascending worker index


def partition(topk_ids: torch.Tensor, topk_weights: torch.Tensor, owners: np.ndarray) -> DispatchPlan:
    """topk_ids, topk_weights: [T, k]; owners: [E] int64, the worker that holds each expert."""
    num_tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1).cpu().numpy().astype(np.int32, copy=False)  # [P = T*k]
    weights = topk_weights.reshape(-1).float().cpu().numpy()  # [P]
    order = np.argsort(owners[ids], kind="stable")  # pairs grouped by worker, token order kept in each
    sorted_ids = ids[order]
    workers = owners[sorted_ids]  # [P] ascending
    tokens = order // k  # [P] token of each pair
    new_worker = np.empty(len(order), dtype=bool)  # first pair of a worker
    new_worker[0] = True
    np.not_equal(workers[1:], workers[:-1], out=new_worker[1:])
    new_row = new_worker.copy()  # first pair of a (worker, token)
    new_row[1:] |= tokens[1:] != tokens[:-1]
    row_number = np.cumsum(new_row) - 1  # [P] global row count; less its worker's first, its row index
    starts = np.flatnonzero(new_worker)
    row_starts = row_number[starts]
    pairs = np.empty((3, len(order)), dtype=np.int32)
    pairs[0] = row_number - row_starts[np.cumsum(new_worker) - 1]
    pairs[1] = sorted_ids
    pairs[2] = weights[order].view(np.int32)
    rows = tokens[new_row]  # [sum of T_w] each worker's rows, back to back
    bounds, row_bounds = [*starts.tolist(), len(order)], [*row_starts.tolist(), len(rows)]
    slices = tuple(
        WorkerSlice(worker, torch.from_numpy(rows[row_bounds[i] : row_bounds[i + 1]]),
                    torch.from_numpy(pairs[:, bounds[i] : bounds[i + 1]].copy()))  # fmt: skip
        for i, worker in enumerate(workers[starts].tolist())
    )
    return DispatchPlan(num_tokens=num_tokens, slices=slices)
