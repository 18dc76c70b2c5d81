"""This worker's experts, validated requests in, float32 partials out."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from expert_server.weights import LoadedShard
from protos.checkpoint import MoeCheckpoint

HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RequestError(ValueError):
    """A request that is malformed or asks for something this worker does not hold."""


@dataclass(frozen=True, slots=True)
class ExpertBatch:
    """One validated Forward request.

    hidden:       [T, H] float
    pair_rows:    [P] int64 in [0, T)
    pair_experts: [P] int64 expert index within the shard
    pair_weights: [P] float32
    """

    layer: int
    shard: int  # index into LocalExperts.shards
    hidden: torch.Tensor
    pair_rows: torch.Tensor
    pair_experts: torch.Tensor
    pair_weights: torch.Tensor


@dataclass(frozen=True, slots=True)
class HeldShard:
    """Experts [start, end) of every MoE layer, loaded."""

    start: int
    end: int
    loaded: LoadedShard


class LocalExperts:
    """The shards of one checkpoint this worker holds (protos/placement.py); a request computes
    experts of one of them."""

    def __init__(self, ckpt: MoeCheckpoint, shards: list[HeldShard], device: torch.device):
        assert shards, "a worker holds at least one shard"
        self.ckpt = ckpt
        self.shards = sorted(shards, key=lambda s: s.start)
        self.device = device
        first = self.shards[0].loaded
        self.layers = tuple(first.layers)
        self.kernel_backend, self.weight_format = first.kernel_backend, first.weight_format
        self.load_format, self.group_size = first.load_format, first.group_size

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.shards]

    def make_batch(
        self,
        layer: int,
        hidden: torch.Tensor,
        pair_rows: torch.Tensor,
        pair_experts: torch.Tensor,
        pair_weights: torch.Tensor,
    ) -> ExpertBatch:
        """Check a decoded request against what this worker holds."""
        if layer not in self.layers:
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
        shard, start = 0, self.shards[0].start
        if num_pairs:
            low, high = np.minimum.reduce(rows), np.maximum.reduce(rows)
            if low < 0 or high >= hidden.shape[0]:
                raise RequestError(f"pair_rows must lie in [0, {hidden.shape[0]}), got [{low}, {high}]")
            low, high = np.minimum.reduce(experts), np.maximum.reduce(experts)
            shard = next((i for i, s in enumerate(self.shards) if s.start <= low and high < s.end), None)
            if shard is None:
                held = ", ".join(f"[{s.start}, {s.end})" for s in self.shards)
                raise RequestError(f"expert ids [{low}, {high}] are not within one of this worker's shards: {held}")
            start = self.shards[shard].start
            keys = rows * self.ckpt.num_experts + experts
            keys.sort()
            if num_pairs > 1 and np.equal(keys[1:], keys[:-1]).any():
                raise RequestError("a (row, expert) pair appears more than once")
        return ExpertBatch(
            layer=layer,
            shard=shard,
            hidden=hidden.to(self.device),
            pair_rows=torch.from_numpy(rows).to(self.device),
            pair_experts=torch.from_numpy(experts - start).to(self.device),
            pair_weights=pair_weights.to(self.device),
        )

    def forward(self, batch: ExpertBatch) -> torch.Tensor:
        """[T, H] float32 partial: router-weighted sum of the shard's experts per row."""
        experts = self.shards[batch.shard].loaded.layers[batch.layer]
        return experts(batch.hidden, batch.pair_rows, batch.pair_experts, batch.pair_weights).cpu()
