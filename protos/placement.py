"""Which workers hold which routed experts.

The experts of every MoE layer are cut into W contiguous shards, one per worker, and each shard is
held by R workers in a ring (R = 1: worker w holds shard w, nothing else):

    shard s = experts [start(s), end(s))         held by workers s, s+1, ..., s+R-1 (mod W)
    worker w holds shards w, w-1, ..., w-R+1 (mod W)

A worker computes one shard per request and the attention node sums the shards' partials in shard
order, so the tokens do not depend on which replica of a shard answered.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Placement:
    """W shards of E experts over W workers, each shard on R of them.

    With E divisible by W shard s is [s*E/W, (s+1)*E/W); otherwise the first
    E % W shards hold one extra expert (as vLLM's linear EP placement).
    """

    num_experts: int
    num_workers: int
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.num_experts < self.num_workers:
            raise ValueError(f"{self.num_experts} experts cannot be spread over {self.num_workers} workers")
        if not 1 <= self.replicas <= self.num_workers:
            raise ValueError(f"expert replicas must be 1 to {self.num_workers} (the number of workers), got {self.replicas}")

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Experts [start, end) of `shard`."""
        if not 0 <= shard < self.num_workers:
            raise ValueError(f"shard {shard} is outside [0, {self.num_workers})")
        base, extra = divmod(self.num_experts, self.num_workers)
        start = shard * base + min(shard, extra)
        return start, start + base + (1 if shard < extra else 0)

    def shard_table(self) -> np.ndarray:
        """[E] int64: the shard of each global expert id."""
        shards = np.empty(self.num_experts, dtype=np.int64)
        for s in range(self.num_workers):
            start, end = self.shard_range(s)
            shards[start:end] = s
        return shards

    def worker_shards(self, worker: int) -> list[int]:
        """The shards `worker` holds, ascending."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker index {worker} is outside [0, {self.num_workers})")
        return sorted((worker - r) % self.num_workers for r in range(self.replicas))

    def worker_ranges(self, worker: int) -> list[tuple[int, int]]:
        """The expert ranges `worker` holds, one per shard, ascending."""
        return [self.shard_range(s) for s in self.worker_shards(worker)]

    def worker_experts(self, worker: int) -> set[int]:
        """The global expert ids `worker` holds in its shards."""
        return {e for start, end in self.worker_ranges(worker) for e in range(start, end)}

    def replica_workers(self, shard: int, turn: int = 0) -> list[int]:
        """The workers holding `shard`, in the order to ask them: each turn (a layer, a micro-batch)
        starts one replica further round, which spreads the shards over their replicas while every
        worker still gets one shard per turn."""
        self.shard_range(shard)  # validates
        return [(shard + (turn + r) % self.replicas) % self.num_workers for r in range(self.replicas)]


REPLICA_MEMORY_SHARE = 0.8  # of the memory free to a worker, what its shards may take


def choose_replicas(expert_bytes: int, num_workers: int, free_bytes_per_worker: int) -> tuple[int, str]:
    """The default R: 2 where two shards fit in REPLICA_MEMORY_SHARE of a worker's free memory,
    else 1; and the reason, for the log. `expert_bytes`: every routed expert of every layer."""
    if num_workers < 2:
        return 1, "one worker"
    shard = expert_bytes / num_workers
    budget = REPLICA_MEMORY_SHARE * free_bytes_per_worker
    fits = f"{shard / 2**20:.1f} MiB shards, {budget / 2**20:.0f} MiB usable per worker"
    if 2 * shard <= budget:
        return 2, f"two {fits}"
    return 1, f"two {fits} do not fit: no spare copy, a lost worker stalls its experts"


def available_host_memory() -> int:
    """Linux's MemAvailable: free memory plus what the kernel would reclaim for it."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def replicas_flag(text: str) -> int | None:
    """The --expert-replicas flag: a count, or auto (None)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of replicas or auto, got {text!r}") from None
