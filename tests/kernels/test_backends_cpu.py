"""Backends against the reference on CPU: the `cpu` backend (torch's int4 CPU GEMM) and the
Triton kernels' logic through Triton's interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.backends.cpu import CpuBackend
from kernels.reference import moe_experts_w4a16_reference

# (hidden, intermediate, group): K and N not multiples of 64/128, three group sizes
SHAPES = [(160, 96, 32), (192, 320, 64), (384, 256, 128)]
TOKENS = [1, 3, 17]  # tokens per expert: one, odd, more than one 16-row tile


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_cpu_backend_matches_reference(moe_problem, row_rel_error, hidden, inter, group, tokens):
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=tokens)
    backend = CpuBackend()
    assert backend.supports_quant_scheme(p.weights.scheme).ok
    experts = backend.prepare(p.weights, "silu", torch.device("cpu"))
    out = experts(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights)
    # the backend runs bf16 activations: compare against the reference on the same rounded input
    x = p.hidden.to(torch.bfloat16)
    ref = moe_experts_w4a16_reference(x, p.pair_rows, p.pair_experts, p.pair_weights, p.weights)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # the kernel rounds the intermediate activations to bf16 as well (2^-8 relative each): worst row 8e-3
    assert row_rel_error(out, ref) < 1.5e-2
    untouched = torch.ones(p.hidden.shape[0], dtype=torch.bool)
    untouched[p.pair_rows] = False
    assert torch.equal(out[untouched], torch.zeros_like(out[untouched]))


def test_cpu_backend_gelu(moe_problem, row_rel_error):
    p = moe_problem(experts=2, hidden=128, inter=64, group=32, tokens_per_expert=3)
    out = CpuBackend().prepare(p.weights, "gelu", torch.device("cpu"))(
        p.hidden, p.pair_rows, p.pair_experts, p.pair_weights
    )
    ref = moe_experts_w4a16_reference(
        p.hidden.to(torch.bfloat16), p.pair_rows, p.pair_experts, p.pair_weights, p.weights, "gelu"
    )
    assert row_rel_error(out, ref) < 1.5e-2


def test_triton_kernels_in_interpreter(tmp_path):
    """The Triton kernels' indexing, masking and nibble order, run by Triton's CPU interpreter.

    fp16 only: the interpreter mis-handles bitcasts to bf16 (real GPUs run bf16 in test_backends_gpu).
    The PTX dequantization is GPU-only too. A subprocess, since TRITON_INTERPRET is read at import.
    The CPU stand-in for the GPU tests (interpreters differ across Triton versions: this one is 3.9's).
    """
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: test_backends_gpu runs these kernels for real")
    script = Path(__file__).with_name("triton_interpreter_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checked" in result.stdout


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("tokens,pairs", [(1, 1), (1, 3), (5, 12), (64, 200), (3, 0)])
def test_dense_reference_matches_the_oracle(activation, tokens, pairs):
    """16-bit experts as workers serve them (weights converted once) against the oracle, which
    converts per call: the same float32 math, a row touched by several experts included."""
    from kernels.backends.reference import DenseReference
    from kernels.reference import DenseExpertWeights, moe_experts_reference

    g = torch.Generator().manual_seed(tokens * 1000 + pairs)
    experts, hidden, inter = 4, 96, 40
    weights = DenseExpertWeights(w13=torch.randn(experts, 2 * inter, hidden, generator=g).to(torch.bfloat16),
                                 w2=torch.randn(experts, hidden, inter, generator=g).to(torch.bfloat16))  # fmt: skip
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    # unique (row, expert) pairs, as a request carries them
    keys = torch.randperm(tokens * experts, generator=g)[:pairs]
    rows, ids = (keys // experts).to(torch.int32), (keys % experts).to(torch.int32)
    w = torch.rand(pairs, generator=g)
    out = DenseReference(weights, activation)(x, rows, ids, w)
    ref = moe_experts_reference(x, rows.long(), ids.long(), w, weights, activation)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
