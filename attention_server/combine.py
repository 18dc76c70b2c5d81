"""Stage 6: sum the shards' partials per token in float64, in a fixed order."""
from __future__ import annotations

import numpy as np
import torch

from attention_server.partition import DispatchPlan


def combine(plan: DispatchPlan, partials: list[torch.Tensor], hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """partials[i]: [T_s, H] float32 for plan.slices[i]. Returns [T, H] in `dtype`.

    Shards are added in ascending order whatever order their answers arrived in and
    whichever replica computed them, so the result is bitwise reproducible.
    """
    assert len(partials) == len(plan.slices), "one partial per shard slice"
    # numpy: a handful of operations per layer and step, where torch's dispatch would cost more than
    # the arithmetic at decode sizes. A slice's rows are unique, so `+=` on them adds each once.
    out = np.zeros((plan.num_tokens, hidden_size), dtype=np.float64)
    for part, partial in zip(plan.slices, partials):
        if part.rows.shape[0] == plan.num_tokens:  # every token (rows are ascending): no gather-scatter
            out += partial.numpy()
        else:
            out[part.rows.numpy()] += partial.numpy()
    return torch.from_numpy(out).to(dtype)
