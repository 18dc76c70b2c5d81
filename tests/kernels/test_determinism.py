"""Every backend's output is bitwise identical run to run for the same inputs (issue 11).

A worker's partial, and so the cluster's tokens, must not depend on the order GPU programs
finish. The problems put many pairs on each row (top-8 of 32 experts), so a float-atomic sum
(the kernels before this test) gives different bits from run to run: on an H200 all 7 GPU cases
failed on the atomic Triton and CUDA kernels (2026-12-02, README). CPU backends run in
CI; GPU backends are marked `gpu` and skipped without a device.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.backends.reference import DenseReference
from kernels.backends.triton_moe import TritonConfig, TritonExperts, has_dependent_launch
from kernels.oracle import create_backend
from kernels.quant import W4A16ExpertWeights
from kernels.reference import DenseExpertWeights
from tests.kernels.conftest import random_int4

RUNS = 5


def _problem(rows: int, experts: int = 32, top_k: int = 8, hidden: int = 2048, inter: int = 768, seed: int = 0):
    """Shuffled top-k pairs per row, row-major as the attention node sends them."""
    gen = torch.Generator().manual_seed(seed)
    weights = W4A16ExpertWeights(random_int4(experts, 2 * inter, hidden, 128, gen),
                                 random_int4(experts, hidden, inter, 128, gen))  # fmt: skip
    pair_experts = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)]).flatten()
    pair_rows = torch.arange(rows).repeat_interleave(top_k)
    pair_weights = torch.rand(rows * top_k, generator=gen)
    hidden_states = torch.randn(rows, hidden, generator=gen)
    return weights, (hidden_states, pair_rows, pair_experts, pair_weights)


def _assert_bitwise_repeatable(name: str, device: torch.device, rows: int, **shape) -> None:
    weights, args = _problem(rows, **shape)
    args = tuple(a.to(device) for a in args)
    experts = create_backend(name).prepare(weights, "silu", device)
    first = experts(*args)
    assert first.abs().max() > 0, "an all-zero output would repeat trivially"
    for run in range(1, RUNS):
        again = experts(*args)
        differ = (again != first).sum().item()
        assert differ == 0, f"{name}: run {run} differs from run 0 in {differ} of {first.numel()} elements"


@pytest.mark.parametrize("name", ["cpu", "reference"])
def test_cpu_backends_are_bitwise_repeatable(name):
    _assert_bitwise_repeatable(name, torch.device("cpu"), rows=6, experts=8, hidden=256, inter=128)


@pytest.mark.parametrize("rows", [1, 6])
def test_dense_reference_is_bitwise_repeatable(rows):
    """The workers' path for 16-bit checkpoints (kernels/csrc/dense_experts.c on the CPU)."""
    gen = torch.Generator().manual_seed(rows)
    weights = DenseExpertWeights(torch.randn(8, 256, 256, generator=gen).to(torch.bfloat16),
                                 torch.randn(8, 256, 128, generator=gen).to(torch.bfloat16))  # fmt: skip
    experts = DenseReference(weights, "silu")
    pair_experts = torch.stack([torch.randperm(8, generator=gen) for _ in range(rows)]).flatten()
    args = (torch.randn(rows, 256, generator=gen).to(torch.bfloat16), torch.arange(rows).repeat_interleave(8),
            pair_experts, torch.rand(rows * 8, generator=gen))  # fmt: skip
    first = experts(*args)
    assert first.abs().max() > 0, "an all-zero output would repeat trivially"
    for run in range(1, RUNS):
        assert torch.equal(experts(*args), first), f"run {run} differs from run 0"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "hip_fdot2"])
@pytest.mark.parametrize("rows", [1, 16, 512, 2048])  # decode, a larger decode batch, prefill (two tiles)
def test_gpu_backends_are_bitwise_repeatable(cuda, name, rows):
    _assert_bitwise_repeatable(name, cuda, rows)


@pytest.mark.gpu
def test_hip_fdot2_split_k_is_bitwise_repeatable(cuda):
    """K split into three chunks (H = I = 6144 at 8 rows staged): the chunk sums are ordered too."""
    _assert_bitwise_repeatable("hip_fdot2", cuda, rows=8, experts=2, top_k=2, hidden=6144, inter=6144)


@pytest.mark.gpu
# main's decode grid, the row-block grid, prefill tiles, few experts with down's k-blocks split
@pytest.mark.parametrize("rows,experts,top_k", [(1, 32, 8), (64, 32, 8), (512, 32, 8), (16, 8, 2)])
def test_triton_dependent_launch_changes_no_bit(cuda, rows, experts, top_k):
    """Programmatic dependent launch only moves when programs start: for_load's configuration gives the
    bits it gives launched without it, call after call (a program that read before its wait would not)."""
    if not has_dependent_launch(cuda):
        pytest.skip("this GPU has no programmatic dependent launch (sm_90+)")
    weights, args = _problem(rows, experts=experts, top_k=top_k)
    args = tuple(a.to(cuda) for a in args)
    config = TritonConfig.for_load(rows * top_k, experts)
    assert config.dependent_launch
    serial = TritonExperts(weights, "silu", cuda, replace(config, dependent_launch=False))
    expected = serial(*args)
    dependent = serial.configured(config)
    for run in range(RUNS):
        differ = (dependent(*args) != expected).sum().item()
        assert differ == 0, f"call {run} with dependent launches differs in {differ} of {expected.numel()} elements"


@pytest.mark.gpu
# sorting the rows too, or not: ranking either way; counting, or ranking the experts alone; counting either way
@pytest.mark.parametrize("rows", [1, 16, 1000, 20000])
def test_triton_rows_ascending_changes_no_bit(cuda, rows):
    """The promise that the rows ascend only spares sorting them: the bits the call gives without it."""
    weights, args = _problem(rows)
    args = tuple(a.to(cuda) for a in args)
    experts = create_backend("triton").prepare(weights, "silu", cuda)
    expected = experts(*args)
    for run in range(RUNS):
        differ = (experts(*args, rows_ascending=True) != expected).sum().item()
        assert differ == 0, f"call {run} with ascending rows differs in {differ} of {expected.numel()} elements"
