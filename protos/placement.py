"""Which worker holds which routed expert."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Placement:
    """Contiguous placement: worker w holds experts [start(w), end(w)).

    With E divisible by W that is [w*E/W, (w+1)*E/W); otherwise the first
    E % W workers hold one extra expert (as vLLM's linear EP placement).
    """

    num_experts: int
    num_workers: int

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.num_experts < self.num_workers:
            raise ValueError(
                f"{self.num_experts} experts cannot be spread over {self.num_workers} workers"
            )

    def expert_range(self, worker: int) -> tuple[int, int]:
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker index {worker} is outside [0, {self.num_workers})")
        base, extra = divmod(self.num_experts, self.num_workers)
        start = worker * base + min(worker, extra)
        return start, start + base + (1 if worker < extra else 0)

    def owner_table(self) -> np.ndarray:
        """[E] int64: owning worker of each global expert id."""
        owners = np.empty(self.num_experts, dtype=np.int64)
        for w in range(self.num_workers):
            start, end = self.expert_range(w)
            owners[start:end] = w
        return owners
