"""Stage 6: sum worker partials per token in float64, in a fixed order."""
from __future__ import annotations

import torch

from attention_server.partition import DispatchPlan


def combine(plan: DispatchPlan, partials: list[torch.Tensor], hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """partials[i]: [T_w, H] float32 for plan.slices[i]. Returns [T, H] in `dtype`.

    Workers are added in ascending index whatever order their answers arrived
    in, so the result is bitwise reproducible.
    """
    assert len(partials) == len(plan.slices), "one partial per worker slice"
    out = torch.zeros(plan.num_tokens, hidden_size, dtype=torch.float64)
    for part, partial in zip(plan.slices, partials):
        out.index_add_(0, part.rows, partial.double())
    return out.to(dtype)
