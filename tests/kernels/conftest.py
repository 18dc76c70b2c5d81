"""Shared fixtures for kernel tests: random int4 experts, routing problems, the GPU gate."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.quant import Int4Weights, W4A16ExpertWeights, pack_int4


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA/ROCm device; skipped (not passed) without one")


@pytest.fixture
def cuda() -> torch.device:
    """The GPU; skips the test, never passes it, on a machine without one."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device: GPU kernel tests run on the GPU machine (pytest -m gpu)")
    return torch.device("cuda")


def random_int4(experts: int, n: int, k: int, group: int, generator: torch.Generator) -> Int4Weights:
    """Uniform nibbles and signed scales (about half negative, as auto-round writes them)."""
    q = torch.randint(0, 16, (experts, n, k), generator=generator)
    scales = torch.randn(experts, n, k // group, generator=generator) * 0.05
    return Int4Weights(pack_int4(q), scales, group)


@dataclass(frozen=True, slots=True)
class MoeProblem:
    weights: W4A16ExpertWeights
    hidden: torch.Tensor  # [T, H] float32
    pair_rows: torch.Tensor  # [P]
    pair_experts: torch.Tensor  # [P]
    pair_weights: torch.Tensor  # [P] float32

    def to(self, device: torch.device) -> MoeProblem:
        return MoeProblem(
            self.weights, self.hidden.to(device), self.pair_rows.to(device),
            self.pair_experts.to(device), self.pair_weights.to(device),
        )


def make_problem(
    experts: int, hidden: int, inter: int, group: int, tokens_per_expert: int, seed: int = 0
) -> MoeProblem:
    """Every other expert gets `tokens_per_expert` pairs (distinct rows), the rest none.

    Rows: 2 * tokens_per_expert + 1, so rows hold different numbers of pairs and one row may hold none.
    """
    gen = torch.Generator().manual_seed(seed)
    w13 = random_int4(experts, 2 * inter, hidden, group, gen)
    w2 = random_int4(experts, hidden, inter, group, gen)
    rows = 2 * tokens_per_expert + 1
    pair_rows, pair_experts = [], []
    for e in range(0, experts, 2):
        pair_rows.append(torch.randperm(rows, generator=gen)[:tokens_per_expert])
        pair_experts.append(torch.full((tokens_per_expert,), e))
    pair_rows_t = torch.cat(pair_rows)
    return MoeProblem(
        weights=W4A16ExpertWeights(w13, w2),
        hidden=torch.randn(rows, hidden, generator=gen),
        pair_rows=pair_rows_t,
        pair_experts=torch.cat(pair_experts),
        pair_weights=torch.rand(pair_rows_t.numel(), generator=gen),
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|; expected must not be all zero (a vacuous match)."""
    scale = expected.abs().max().item()
    assert scale > 0, "the reference output is all zero: the comparison would prove nothing"
    return (actual.float().cpu() - expected.float().cpu()).abs().max().item() / scale


def row_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst row's ||actual - expected|| / ||expected|| over the rows the reference computed (nonzero).

    A max-over-max error lets a small row be wrong by its whole size while a large row sets the scale.
    """
    actual, expected = actual.float().cpu(), expected.float().cpu()
    norms = expected.norm(dim=-1)  # [T]
    computed = norms > 0
    assert computed.any(), "the reference output is all zero: the comparison would prove nothing"
    return ((actual - expected)[computed].norm(dim=-1) / norms[computed]).max().item()


@pytest.fixture
def moe_problem():
    """make_problem(experts, hidden, inter, group, tokens_per_expert, seed=0) -> MoeProblem."""
    return make_problem


@pytest.fixture
def rel_error():
    """relative_error(actual, expected) -> float."""
    return relative_error


@pytest.fixture
def row_rel_error():
    """row_relative_error(actual, expected) -> float."""
    return row_relative_error
