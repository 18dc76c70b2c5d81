"""Run by test_backends_cpu under TRITON_INTERPRET=1: Triton kernels vs the reference on CPU tensors."""
from __future__ import annotations

import torch

from kernels.backends.triton_moe import TritonConfig, TritonExperts
from kernels.quant import Int4Weights, W4A16ExpertWeights, pack_int4
from kernels.reference import moe_experts_w4a16_reference


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    # (experts, hidden, inter, group, tokens per expert, rows, config): partial N tiles, 2 M tiles,
    # gelu; rows None = 2 * tokens + 1. The last puts all 20 pairs on one row: the combine adds
    # more than one window (COMBINE_BLOCK_R = 16) of a row's pairs.
    cases = [
        (3, 160, 96, 32, 1, None, TritonConfig(block_n_gate_up=64, block_n_down=64), "silu"),
        (2, 192, 64, 64, 17, None, TritonConfig(block_n_gate_up=32, block_n_down=128), "gelu"),
        (20, 128, 64, 32, 1, 1, TritonConfig(), "silu"),
    ]
    for experts, hidden, inter, group, tokens, rows, config, activation in cases:
        def int4(n: int, k: int) -> Int4Weights:
            q = torch.randint(0, 16, (experts, n, k), generator=gen)
            return Int4Weights(pack_int4(q), torch.randn(experts, n, k // group, generator=gen) * 0.05, group)

        weights = W4A16ExpertWeights(int4(2 * inter, hidden), int4(hidden, inter))
        rows = rows or 2 * tokens + 1
        pair_rows = torch.cat([torch.randperm(rows, generator=gen)[:tokens] for _ in range(experts)])
        pair_experts = torch.arange(experts).repeat_interleave(tokens)
        pair_weights = torch.rand(pair_rows.numel(), generator=gen)
        x = torch.randn(rows, hidden, generator=gen).to(torch.float16)
        out = TritonExperts(weights, activation, torch.device("cpu"), config)(x, pair_rows, pair_experts, pair_weights)
        ref = moe_experts_w4a16_reference(x, pair_rows, pair_experts, pair_weights, weights, activation)
        err = (out - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, f"case {experts, hidden, inter, group, tokens}: relative error {err}"
    print("checked", len(cases), "cases")


if __name__ == "__main__":
    main()
