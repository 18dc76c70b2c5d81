"""Run by test_backends_cpu under TRITON_INTERPRET=1: Triton kernels vs the reference on CPU tensors,
and the routing against torch's stable sorts."""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import torch

from kernels.backends import triton_moe
from kernels.backends.triton_moe import TritonConfig, TritonExperts
from kernels.quant import Int4Weights, W4A16ExpertWeights, pack_int4
from kernels.reference import moe_experts_w4a16_reference


def check_route(experts: int, pairs: int, num_rows: int, gen: torch.Generator, rows_ascending: bool) -> None:
    """Both routings give exactly torch's stable sorts: one ranking launch and, above
    ROUTE_SCAN_MAX_WORK, counting (several blocks; by row one pass, or two past 8 row bits). Rows given in
    ascending order are not sorted (by row, position j is pair j); above ROUTE_SCAN_MAX_PAIRS_ASCENDING their
    experts are counted by chunks."""
    pair_experts = torch.randint(0, experts, (pairs,), generator=gen)
    pair_rows = torch.randint(0, num_rows, (pairs,), generator=gen)
    if rows_ascending:
        pair_rows = pair_rows.sort().values
    pair_weights = torch.rand(pairs, generator=gen)
    def int4(n: int, k: int) -> Int4Weights:  # values unused: routing only
        return Int4Weights(pack_int4(torch.zeros(experts, n, k, dtype=torch.long)), torch.ones(experts, n, 1), k)

    prepared = TritonExperts(W4A16ExpertWeights(int4(64, 32), int4(32, 32)), "silu", torch.device("cpu"))
    routes = prepared.route(pair_rows, pair_experts, pair_weights, num_rows, rows_ascending)
    counts = torch.bincount(pair_experts, minlength=experts)
    assert torch.equal(routes.bounds.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    by_expert = torch.sort(pair_experts, stable=True).indices
    assert torch.equal(routes.pairs.long(), by_expert)
    assert torch.equal(routes.rows.long(), pair_rows[by_expert])
    assert torch.equal(routes.router, pair_weights[by_expert])
    by_row = torch.sort(pair_rows, stable=True)
    assert torch.equal(routes.crows.long(), by_row.values)
    if rows_ascending:
        assert routes.cpairs is None
    else:
        assert torch.equal(routes.cpairs.long(), by_row.indices)
    row_counts = torch.bincount(pair_rows, minlength=num_rows)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), row_counts.cumsum(0)])  # row t: [starts[t], starts[t+1])
    assert torch.equal(routes.row_bounds.long(), starts)


def with_nan_buffers(fn):
    """fn() with every floating-point buffer that torch.empty allocates filled with NaN, so an element the layer
    returns without writing it shows."""
    allocate = torch.empty

    def poisoned(*args, **kwargs):
        t = allocate(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with mock.patch.object(torch, "empty", poisoned):
        return fn()


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    # (experts, pairs, rows): one ranking launch (a key per program; 8 keys; 2 keys over two steps of pairs),
    # then the counting passes, forced (the first sorts whole rows of 8 and of WHOLE_ROW_BITS = 10 bits; then
    # 8-bit digits: one more pass by row; two more; then pairs filling whole counting blocks of 256, rows past the last
    # pair's; 6 experts: digits past the last expert). Ascending rows by chunks, 8 or fewer of up to 512 pairs: 6 of 256
    # pairs, the last partial (both cases of 1500 pairs); 18 of 512 (more chunks, at the cap); 6 of 512; 8 of 256, the
    # last full; 4 of 256.
    ranked = [(6, 37, 50), (4, 50, 5000), (3, 600, 1 << 9), (128, 3000, 1000)]
    counted = [(128, 1500, 200), (128, 1500, 1000), (128, 9000, 1 << 12), (128, 3000, 1 << 17), (128, 2048, 3000),
               (6, 1000, 40)]
    for rows_ascending in (False, True):
        for experts, pairs, num_rows in ranked:
            check_route(experts, pairs, num_rows, gen, rows_ascending)
        names = "ROUTE_SCAN_MAX_WORK", "ROUTE_SCAN_MAX_PAIRS_ASCENDING", "ROUTE_CHUNKS", "ROUTE_CHUNK_MAX"
        with mock.patch.multiple(triton_moe, **dict(zip(names, (0, 0, 8, 512), strict=True))):
            for experts, pairs, num_rows in counted:
                check_route(experts, pairs, num_rows, gen, rows_ascending)
    # (experts, hidden, inter, group, tokens per expert, rows, config); rows None = 2 * tokens + 1. First: partial
    # N tiles; second: 2 M tiles, gelu, and again with every buffer NaN (its rows without pairs must be zeros); third:
    # all 20 pairs on one row, so the combine adds more than one window (COMBINE_BLOCK_R = 8) of a row's pairs; fourth:
    # main's decode grid (a program per expert and column block walks the expert's two row blocks), down's one k-block
    # split three ways (two empty splits); fifth and sixth: the prefill path (weights as the left operand with the
    # scales on them, blocks of two stored tiles, the last one partial: N 160 padded to 192 against blocks of 128;
    # three row blocks per expert, two per column turn), the sixth without swapping, with scales on the partials and
    # down's two k-blocks split in two; seventh and eighth: a gate_up program takes several column blocks
    # (tiles_gate_up): both prefill blocks, the second partial; three decode ones; ninth: down's pair rows in fp32, the
    # others' in bf16 (stores and loads only: no bitcast to bf16).
    prefill = TritonConfig(block_m=32, block_n_gate_up=128, block_n_down=128, tile_n_down=64, swap_ab=True,
                           scale_weights=True, group_m=2, num_warps=8)
    cases = [
        (3, 160, 96, 32, 1, None, TritonConfig(block_n_gate_up=64, block_n_down=64, tile_n_down=64), "silu"),
        (2, 192, 64, 64, 17, None, TritonConfig(block_n_gate_up=32, tile_n_gate_up=32), "gelu"),
        (20, 128, 64, 32, 1, 1, TritonConfig(), "silu"),
        (3, 160, 96, 32, 17, None, TritonConfig(expert_grid=True, split_k=3), "gelu"),
        (3, 160, 160, 32, 70, None, prefill, "silu"),
        (2, 128, 160, 32, 70, None, TritonConfig(block_m=32, block_n_gate_up=128, block_n_down=128, group_m=3,
                                                 split_k=2), "gelu"),
        (3, 160, 160, 32, 70, None, replace(prefill, tiles_gate_up=2), "gelu"),
        (2, 192, 192, 64, 17, None, TritonConfig(tiles_gate_up=3), "silu"),
        (3, 160, 160, 32, 70, None, replace(prefill, bf16_pair_rows=False), "silu"),
    ]
    for i, (experts, hidden, inter, group, tokens, rows, config, activation) in enumerate(cases):
        def int4(n: int, k: int) -> Int4Weights:
            q = torch.randint(0, 16, (experts, n, k), generator=gen)
            return Int4Weights(pack_int4(q), torch.randn(experts, n, k // group, generator=gen) * 0.05, group)

        weights = W4A16ExpertWeights(int4(2 * inter, hidden), int4(hidden, inter))
        rows = rows or 2 * tokens + 1
        pair_rows = torch.cat([torch.randperm(rows, generator=gen)[:tokens] for _ in range(experts)])
        pair_experts = torch.arange(experts).repeat_interleave(tokens)
        pair_weights = torch.rand(pair_rows.numel(), generator=gen)
        x = torch.randn(rows, hidden, generator=gen).to(torch.float16)
        prepared = TritonExperts(weights, activation, torch.device("cpu"), config)
        out = prepared(x, pair_rows, pair_experts, pair_weights)
        ref = moe_experts_w4a16_reference(x, pair_rows, pair_experts, pair_weights, weights, activation)
        err = (out - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, f"case {experts, hidden, inter, group, tokens}: relative error {err}"
        if i == 1:  # rows without pairs: zeros, written by the combine whatever the buffer held
            empty = torch.ones(rows, dtype=torch.bool)
            empty[pair_rows] = False
            assert empty.any()
            again = with_nan_buffers(lambda: prepared(x, pair_rows, pair_experts, pair_weights))
            assert torch.equal(again, out) and not out[empty].any()
        if i in (2, 4):  # the combine over more than one window of a row's pairs; the prefill path
            # the pairs in row order (stable): the same bits with and without the promise that the rows ascend
            order = torch.sort(pair_rows, stable=True).indices
            in_row_order = (x, pair_rows[order], pair_experts[order], pair_weights[order])
            assert torch.equal(prepared(*in_row_order, rows_ascending=True), prepared(*in_row_order))
    print("checked", len(cases), "cases and", 2 * (len(ranked) + len(counted)), "routings")


if __name__ == "__main__":
    main()
