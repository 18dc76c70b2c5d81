"""Triton backend: grouped W4A16 MoE on CUDA and ROCm (gfx11) GPUs, routing, then three launches per layer.

    routing:        pairs grouped by expert and by row -> Routes  (scan_route_kernel, one
                    ranking launch, for few pairs and rows; rows given in ascending order and more pairs:
                    chunk_count_kernel, chunk_place_kernel; else counting sorts: route_count_kernel, cumsum,
                    route_scatter_kernel, and for rows of more than 8 bits digit_count_kernel,
                    cumsum, digit_scatter_kernel per further digit)
    gate_up_kernel: x[rows] @ w13[e]^T -> act(gate) * up          [P, I]  (fp16/bf16)
    down_kernel:    act @ w2[e]^T * router weight -> pair rows     [S, P, H]  (bf16; S = split_k runs of k)
    combine_kernel: each row's pair rows summed in (split, pair) order  [T, H]  (fp32; zeros for a row without
                    pairs), one program per row and COMBINE_BLOCK_N columns
No float atomics anywhere: the output is bitwise identical run to run. On CUDA sm_90+ gate_up, down and
the combine are programmatic dependent launches: each may start under the launch before it and waits for it
before touching memory.
Kernels and weight layout: kernels/triton_w4a16.py.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
from dataclasses import dataclass, replace

import torch

from kernels.activations import ACTIVATION_CODES
from kernels.backends.base import ExpertBackend, PreparedExperts, Support, is_rocm, symmetric_int4_support
from kernels.quant import Int4Weights, QuantScheme, W4A16ExpertWeights, unpack_int4

GROUP_SIZES = (32, 64, 128, 256)
BLOCK_KS = (64, 128)
# A combine program adds COMBINE_BLOCK_R pairs per step (top-8: one step) over COMBINE_BLOCK_N columns, on
# COMBINE_WARPS warps. H200, 2026-12-04, graph us of the combine alone, Qwen3 at M = 8 / 16 / 64 / 256 / 1024, bf16 pair
# rows: 256 columns on 2 warps 6.3 / 9.5 / 28.4 / 104.4 / 410.2, 512 on 4 6.0 / 9.1 / 27.2 / 96.0 / 380.9, 1024 on 4
# 3.8 / 4.6 / 9.9 / 43.9 / 158.7 (about 4.2 TB/s at M = 1024, counting the pair rows read and out written), 2048 on 8
# 3.8 / 4.6 / 10.2 / 44.2 / 156.9; fp32 pair rows 4.4 / 5.4 / 22.4 / 75.0 / 288.0 on 256 columns, 4.3-4.5 / 5.2-5.4 /
# 22.4-23.5 / 74.5-76.4 / 280.1-281.4 on the others.
COMBINE_BLOCK_R, COMBINE_BLOCK_N, COMBINE_WARPS = 8, 1024, 4
ROW_BOUNDS_BLOCK = 1024  # rows a row_bounds_kernel program searches for; pairs of a ranking row program (ascending)
READY_BLOCK = 1024  # counters a routing program zeroes per step
RADIX_BITS = 8  # at most 2^8 digits per routing pass over rows, but for the first pass below
# Rows of up to this many bits the first counting pass sorts whole (up to 2^10 digits): no further pass by row and no
# row_bounds search. H200, 2026-12-04, graph us, best of three interleaved rounds: Qwen3 at M = 64 (1024 rows, 8 + 2
# bits before) routing 34.9 -> 25.1-25.6, layer 281.2-282.2 -> 267.7-271.3; Mixtral at M = 128 / 256 (512 / 1024 rows)
# 671-695 -> 678-691 and 1369-1370 -> 1357-1375, within its spread. 11 bits (Qwen3 M = 128, 2048 rows) took the
# routing from 36.4 to 85.4 (its counts and cumsums grow with the digits), so wider rows keep 8-bit passes.
WHOLE_ROW_BITS = 10
FEW_EXPERTS = 16  # for_load: up to here a layer's experts are few and large (Mixtral), above many and small (Qwen3)
ROUTE_COMPARE_BLOCK = 32  # pairs a counting program compares its own with per step
# Up to (E + T) * P this many, one ranking launch routes (scan_route_kernel); above, the counting passes. It
# replaced main's one-program tl.sort (sort_route_kernel, up to 1024 pairs and rows). H200, 2026-12-03, graph us of
# the routing alone: Qwen3 at M = 1 / 2 / 4 / 8 (128-1024 pairs) sort 3.6 / 4.8 / 6.3 / 11.3 -> ranking 3.0 / 3.4 /
# 3.6 / 4.6; at M = 16 / 64 / 128 counting 15.4 / 34.4 / 36.3 -> ranking 6.7 / 42.7 / 132; Mixtral at M = 8 / 64 /
# 128 sort 3.9 / 6.6 / 12.3 -> 2.9 / 3.6 / 5.1, at 256 counting 29.7 -> 10.1. Whole layer, Qwen3 at M = 1 / 2 / 4 /
# 8 / 16: 103.2 / 104.9 / 107.4 / 114.6 / 128.2 -> 102.1 / 102.9 / 103.7 / 106.6 / 113.1 (best of three interleaved
# rounds); Mixtral's decode within its spread in that run (208-238 us both ways). The sort program signalling its
# dependents at its start changed nothing (within 0.5 us).
ROUTE_SCAN_MAX_WORK = 1 << 22
# Rows given in ascending order (only the experts ranked, each program scanning every pair twice): one ranking
# launch up to this many pairs, else counting by expert alone. H200, 2026-12-05, graph us of the routing alone,
# best of three interleaved rounds, rows sorted too (as before) -> ascending, ranked / counted: Qwen3 at M = 1 / 16 /
# 32 / 64 5.0 / 6.8 / 20.5 / 20.6 -> 4.2 / 6.2 / 9.7 / 17.3 ranked, 17.8 / 20.9 / 23.8 / 25.5 counted; at M = 128
# / 256 / 1024 35.7 / 40.0 / 70.6 -> 31.5 / 64.6 / 256.1 ranked, 27.4 / 29.5 / 45.5 counted; Mixtral at M = 256 /
# 1024 (2048 / 8192 pairs) 10.5 / 31.2 -> 6.4 / 33.1 ranked, 19.3 / 21.2 counted (the ranking's row bounds then
# took a program per row, since ROW_BOUNDS_BLOCK rows each). The whole layer, Qwen3 at M = 32 / 64 / 128 / 256 /
# 1024: 178.9 / 244.3 / 405.0 / 741.9 / 2829.1 -> 165.9 / 237.1 ranked, 392.8 / 726.0 / 2826.9 counted; M = 1-16
# and Mixtral within 1 us or the run's spread.
# Then (H100, 2026-12-06, one run, graph us of the routing alone, best of three interleaved rounds) counting by chunks
# of pairs in two launches (_route_chunks) against the ranking up to 8192 pairs and the three counting launches
# above (count, torch's cumsum, scatter): Qwen3 at M = 1 / 8 / 16 / 32 3.34 / 4.35 / 5.06 / 6.87 ranked -> 6.45 /
# 7.09 / 7.35 / 7.49 by chunks; at M = 64 / 128 / 256 / 1024 11.44 ranked / 16.77 / 17.51 / 35.13 counted -> 8.91 /
# 11.47 / 16.69 / 24.82; Mixtral at M = 16 / 64 / 256 3.34 / 4.19 / 4.87 ranked -> 5.86 / 6.47 / 6.59, at 1024 / 4096
# 11.51 ranked / 13.33 counted -> 6.60 / 6.84. So ranked up to 4096 pairs, by chunks above. The whole Qwen3 layer
# the same run (the old routing first in each round): 230.2 / 374.3 / 721.0 -> 222.4 / 357.3 / 705.4 at M = 64 / 128 /
# 256, but 2726.7 -> 2748.5 at 1024; Mixtral's layer moved by up to 6% between routings 2 us apart (1242 -> 1318 at M =
# 256, where the chunks were forced). Two bench_kernel runs before and after, alternating on one H100, put the layer
# within their spread at every M (README).
ROUTE_SCAN_MAX_PAIRS_ASCENDING = 4096
ROUTE_SCAN_PROGRAMS = 1024  # ranking: the fewest keys per program that keep the programs this few (512: within 1 us)
ROUTE_SCAN_ELEMENTS = 4096  # pairs x keys a ranking program compares per step (2048 / 8192: within 1 us)
# With rows given in ascending order: the ranking programs' warps, and each pair storing the starts of the rows that
# begin at it (one load per pair) instead of a binary search per row (bit_length(P) dependent loads). H100, 2026-12-05,
# one run, graph us, best of three interleaved rounds, Qwen3 at M = 1 / 8 / 16 / 32 / 64, search on 4 warps -> stores on
# 4 warps -> stores on 8 warps (2 warps: slower from M = 8): the routing alone 5.44 / 4.88 / 5.49 / 8.13 / 14.00 -> 4.91
# / 4.24 / 5.53 / 8.14 / 13.85 -> 4.68 / 4.24 / 4.95 / 6.85 / 11.48; the whole layer 119.88 / 125.00 / 137.71 / 170.78 /
# 235.95 -> 117.49 / 123.99 / 136.74 / 170.12 / 234.66 -> 117.72 / 123.57 / 135.91 / 168.74 / 229.68.
ROUTE_SCAN_WARPS = 8
# Counting by chunks (rows ascending, above ROUTE_SCAN_MAX_PAIRS_ASCENDING): ROUTE_CHUNKS chunks or fewer, of a power of
# two from ROUTE_CHUNK_MIN to ROUTE_CHUNK_MAX pairs (past ROUTE_CHUNKS * ROUTE_CHUNK_MAX pairs more chunks, so that a
# program's sort stays this size), a program per chunk in both launches, on ROUTE_CHUNK_WARPS warps; a placing
# program adds up ROUTE_COUNT_ELEMENTS counts per step. The same run as above, against 128 / 256 / 4 warps: 256 chunks
# 42.6 against 24.8 at Qwen3 M = 1024, otherwise within 0.1 us; chunks of at least 128 pairs 10.94 / 16.39 against
# 8.91 / 11.47 at Qwen3 M = 64 / 128, 5.91 against 6.60 at Mixtral M = 1024, otherwise within 0.15 us; 8 warps 14.2 /
# 21.9 / 37.8 / 42.0 at Qwen3 M = 64 / 128 / 256 / 1024, Mixtral within 0.1 us.
ROUTE_CHUNKS = 128
ROUTE_CHUNK_MIN = 256
ROUTE_CHUNK_MAX = 4096
ROUTE_CHUNK_WARPS = 4
ROUTE_COUNT_ELEMENTS = 2048


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Launch parameters; `for_load` picks them from the average pairs per expert and the expert count.

    tile_n_gate_up, tile_n_down and block_k are the stored weight tiles (TritonExperts packs for
    them); a program owns block_m sorted positions of one expert x block_n_* output columns, a
    multiple of the tile. swap_ab computes w @ x^T (the dequantized weights as the left operand); then
    block_m may be 8, x being the MMA's 8-wide operand (mma.sync m16n8k16: half the tensor work of 16 rows);
    scale_weights applies the group scales to the 16-bit weights instead of each group's fp32 partial.
    group_m row blocks take each column block in turn. expert_grid launches main's decode grid
    instead: one program per (expert, column block), walking the expert's row blocks (no row-block
    lookup). block_m_down, swap_ab_down, num_warps_down and num_stages_down default to block_m, swap_ab,
    num_warps and num_stages (for_down). split_k > 1 splits down's k-blocks into that many runs, each its own
    programs and its own [P, H] slice of the pair rows, which the combine adds in split order (more programs
    in flight for few large experts; still no atomics). tiles_gate_up > 1 (row-block grid): a gate_up program
    takes that many adjacent column blocks of its rows in one loop over (column block, k-block), each block's
    epilogue inside it, so its pipeline runs on across blocks; it also compiles to fewer registers
    (kernels/triton_w4a16.py: 155 against 213 per thread for 64 x 64 swapped tiles on 4 warps, sm_90a, Triton 3.9);
    where it does not divide the column blocks, 1.
    tiles_gate_up, H200, 2026-12-04, graph us of the whole layer, best of three interleaved rounds (four runs):
    Qwen3 at M = 64 2 tiles 264.3 / 262.8 / 265.0 / 259.0 against 272.3 / 272.6 / 270.5 / 267.0 (3 tiles 267.1, 4
    263.7 / 258.7, 6 319.0; 2 tiles with 4 stages 300.2, with 128 columns on 8 warps 288.0); not taken elsewhere:
    Qwen3 at M = 8 / 16 2 tiles 105.3 / 112.6 against 95.4 / 112.0, at M = 256 / 1024 2 / 3 tiles 839.9 / 812.9 and
    3142.2 / 3053.1 against 794.9 / 2972.4; Mixtral at M = 64 527.4 against 430.3. The same loop at one tile (no
    other change) was slower from M = 64 (Qwen3 276.5 / 466.5 / 849.7 / 3195.7 against 270.5 / 438.5 / 796.1 /
    2949.8 at M = 64 / 128 / 256 / 1024, Mixtral 506.4 / 1382.9 against 430.3 / 1248.0 at 64 / 256); below, Qwen3
    within 0.5 us, Mixtral 197.0 / 221.4 against 196.9 / 223.6 at M = 1 / 16. Down's k-loop over 2 / 4 column
    blocks the same way spilled (Triton 3.9, sm_90a: 255 registers, 352 bytes of stack at 128 x 128 on 4 warps):
    Qwen3 281.8 / 280.0 at M = 64, 947.8 / 939.0 at 256, 3560.9 / 3535.8 at 1024, against 272.3 / 794.9 / 2972.4
    (4 blocks on 2 stages 835.0 / 3074.3 at 256 / 1024; on 64-column down tiles 845.3 / 3157.6; at M = 16, 2 blocks
    125.7 against 112.0). Nor taken above M = 64: gate_up on 64-row blocks of 64 columns, 2 tiles, on 4 warps, down
    unchanged, 485.5 / 901.6 / 3435.9 against 438.5 / 796.1 / 2949.8 at M = 128 / 256 / 1024; down on 64-column
    tiles (4 warps, 180 registers, no spills on Triton 3.9) 480.4 / 872.9 / 3283.1.
    Not kept either, letting the multi-tile loop's wgmmas overlap: ptxas (sm_90a, Triton 3.9 and 3.6) warns that it
    serializes every wgmma of gate_up's loop when TILES > 1 (C7515: non-wgmma instructions define wgmma accumulators
    within the loop, here the zeros written after each tile's store). Zeroing each tile's accumulators before its first
    MMA instead is a pattern Triton turns into wgmma's own flag, and the warning goes, but it was no faster (H100,
    Triton 3.6, 2026-12-06, Qwen3, graph us, best / median of seven interleaved rounds, bitwise the same): gate_up at
    M = 64 144.6 / 148.5 -> 150.3 (best of three; 191 registers, so at most two programs per SM, not three), and capped
    at 160 registers 142.9 / 144.7 (the layer 235.2 / 248.4 -> 239.4 / 242.5; 152 or 168 registers no better), at M = 48
    132.6 / 140.1 -> 131.5 / 134.8: within this GPU's spread between launches.
    Nor the same for the other 4-warp GEMMs: with Triton 3.6 (the GPU machine's) ptxas also serializes gate_up at one
    tile and down at Qwen3's M = 48-64 (C7515 again: the k-loop's exit for a loop that runs no k-block copies the zeroed
    accumulators; the 8-warp GEMMs above M = 64 and Mixtral's keep seven wgmmas in flight). A k-loop of a constexpr
    length (H and I as constexprs) has no such exit: then ptxas keeps seven in flight there too, but at 197 / 200
    registers, two programs per SM. None was faster (H100, 2026-12-06, graph us, best of three interleaved rounds, layer
    / gate_up / down, outputs bitwise the same): Qwen3 at M = 64 225.3 / 143.2 / 83.7 today, 228.1 / 139.8 / 90.6 with
    down overlapped, 243.0 / 136.0 / 87.7 with gate_up on one tile too, 245.4 / 149.5 / 80.6 with both capped at 168
    registers (three programs per SM), 232.9 / 145.3 / 80.3 with down capped (gate_up's two tiles as today); at M = 48
    214.9 / 132.2 / 77.6 against 219.1 / 131.3 / 81.8, 223.9 / 128.1 / 81.6, 224.4 / 141.1 / 75.1 and 210.9 / 131.3 /
    74.6; Mixtral at M = 64 410.0 against 414.2. So at M = 48-64 the wgmmas' latency is not what bounds these GEMMs.
    What does (ncu, H100, 2026-12-06, Qwen3 at M = 64 as for_load takes it): in gate_up the tensor pipe is active in 41%
    of the cycles and the schedulers issue in 43%; the warps stall most at the CTA barrier that Triton's cp.async
    pipeline puts in every k-step (31% of their cycles), then on fixed-latency dependencies (22%), on global loads
    hardly (5%); down alike (tensor pipe 36%, barrier 28%, dependencies 18%). At M = 256 (8 warps, 128-row blocks)
    gate_up's tensor pipe is active in 58% and barriers take 6%. Global memory is not the bound at M = 64: with the
    loads of x, of the weights or of both masked off (no bytes moved, the rest unchanged) gate_up took 129.5 / 130.6 /
    130.7 us against 135.4 (graph, best of three interleaved rounds), at M = 256 376.5 / 388.3 / 360.3 against 408.5. So
    the candidate for M = 48-64 is a k-loop without CTA barriers (tiles loaded by TMA or a producer warp, buffers
    released through mbarriers: warp specialization), which Triton 3.6 does not make of these kernels: down with its
    act, weight and scale tiles loaded through TMA descriptors (tl.make_tensor_descriptor) still had five CTA barriers
    per k-step (sm_90a) and was slower, 82.7 -> 101.6 us at M = 64 and 81.9 -> 96.4 at M = 48 (bitwise the same output).
    A first warp-specialized down in Gluon (Triton 3.6's triton.experimental.gluon; scratch kernels here and below, not
    kept: one producer warp loading the act, weight and scale tiles by TMA into a ring of mbarrier-guarded buffers, a
    consumer warpgroup dequantizing the next k-step while the last one's wgmmas run, one tile per program, bitwise the
    same output) took 94.1-95.7 us at M = 64 on 4 stages, with one or two consumer warpgroups, against Triton's
    79.0-80.7 (H100, graph, three interleaved rounds each), 102.6-105.6 on 3 stages, 136.2-138.2 on 2. It was not
    barrier-free, as first written here: Gluon puts a warpgroup barrier (bar.sync 0, 128) before every mbarrier.arrive
    (Triton 3.9's Gluon too), and 3.6's shared-memory barrier analysis another before the next k-step's mbarrier.wait on
    the same allocation, so its k-loop had two per step. Without them (H100, 2026-12-06, graph us, three interleaved
    rounds, every output bitwise the same as Triton's), down at M = 64: the k-loop unrolled over one mbarrier allocation
    per stage (4 barriers left per 6-step tile) 93.9-97.5 against the first form's 97.5-106.7 and Triton's 79.4-80.1;
    persistent programs, one per SM, whose consumer warps release each stage on their own (lane 0 of each warp arrives
    on an mbarrier of count 4 through inline PTX, at the shared-memory offset read back from the compiled kernel's PTX;
    no barrier left in the k-loop) 90.0-92.8, with two consumer warpgroups 83.6-85.1. Down's tiles have 6 k-steps at
    Qwen3's I = 768. Gate_up's have 16, and there the same persistent, barrier-free form beat Triton: its producer warp
    gathering x's rows by cp.async (their completion counted on the stage's mbarrier) and loading the gate and up weight
    tiles and their scales by TMA, 4 stages (117 KB, 255 registers: one program per SM), gate_up at M = 64 took
    122.5-128.7 us against Triton's 133.0-146.7 (two runs; on 2 stages 238-245), its output bitwise the same as
    Triton's; ncu: tensor pipe active in 48% of the cycles against Triton's 41%. But not once it did what the layer
    needs of it (H100, same day, one run, every output bitwise the same): reading each expert's rows from the routing's
    bounds (masked) and counting each stored tile in ready for down (a warpgroup barrier and a release atomic at GPU
    scope per tile, on the consumer's warps), it took 159.0-169.3 against Triton's 134.8-141.7, and the layer with it
    256.7-264.5 against 227.4-234.7 at M = 64, 241.1-249.9 against 218.6-223.1 at M = 48; on two consumer warpgroups
    (gate on one, up on the other) 168.4-177.3. Why is not established: with one consumer warpgroup per SM the atomic's
    fence waits on the consumer's path, and each tile's first copies wait on two dependent index loads. With both off
    that path it still lost (H100, 2026-12-07, graph us, three interleaved rounds, every output bitwise the same as
    Triton's): a signalling warp counting the stored tiles and the next tile's rows loaded ahead (255 registers, 116,876
    B of shared memory, 3 warpgroup barriers in the kernel, sm_90a), gate_up alone at M = 64 145.7-150.9 against
    Triton's 135.0-142.1; storing act straight from the wgmma accumulators instead of through shared memory (100,748 B,
    one barrier) 146.8-154.1; the layer with them 247.6-249.3 and 244.0-246.0 against Triton's 223.1-229.3 at M = 64,
    232.9-235.6 and 228.6-235.0 against 215.3-222.1 at M = 48. The Gluon gate_up is not pursued further here; it
    took one 64-row block per expert, bf16 and SiLU only, H a multiple of 512, the Gluon API differs between Triton 3.6
    and 3.9 (tma.async_copy_global_to_shared became tma.async_load), and its per-warp release rests on an offset read
    back from PTX.
    Nor gate_up on k-blocks of 256 (half the loop's steps and CTA barriers; down kept on 128, which spills at 256:
    255 registers and 184-328 bytes of stack, sm_90a, Triton 3.9): on 2 stages 218 registers and 85 KB of shared
    memory, so two programs per SM, not three (H100, Triton 3.6, 2026-12-06, Qwen3, graph us of gate_up alone, best
    of three interleaved rounds, bitwise the same output): 133.4 -> 196.0 at M = 64 (3 stages, one program per SM,
    300.2; one tile per program 176.2), 198.7 / 394.2 / 1560.4 -> 273.7 / 503.8 / 1931.1 at M = 128 / 256 / 1024 (2
    tiles; 1 tile about twice that).
    dependent_launch: programmatic dependent launch (kernels/triton_w4a16.py) where the GPU has it: H200, graph
    us of the whole layer without / with it (2026-12-02, one run), Qwen3 at M = 1 / 2 / 4 / 8 / 16 109.1 /
    111.1 / 114.2 / 122.4 / 133.5 -> 106.1 / 108.8 / 111.7 / 120.2 / 133.1, Mixtral at M = 1 / 4 / 8 / 16
    211.7 / 213.8 / 219.3 / 227.9 -> 209.9 / 212.4 / 217.6 / 226.3, prefill within 2 us. Programs that asked
    L2 for their first 2 / 4 / 8 weight k-blocks before waiting were slower (Qwen3 M = 1: 107.2 / 109.7 /
    116.8 against 106.8), and so were register caps of 96 / 80 per thread for more programs per SM (spills:
    Qwen3 M = 1 111.5 / 117.4 against 106.1, M = 8 198.8 against 120.2).
    wait_per_expert: a down program waits (integer counters, kernels/triton_w4a16.py) for its expert's act tiles
    alone, not for all of gate_up, so down fills the SMs that gate_up's last wave leaves idle (ncu, H200,
    2026-12-04, Qwen3 at M = 1 before it: gate_up 62.5 us with the SMs active 84% of it, down 34.0 us, 84%; 89% /
    87% at M = 8, 96% at M = 64; DRAM at 3.47 / 3.24 TB/s over the kernels, about 4.1 / 3.9 while active).
    The combine waiting likewise for its row's pairs alone (per-pair counters from down), not for all of down,
    was measured and not kept; nor was the combine done inside down (2026-12-04, one run, graph us, best of three
    interleaved rounds): each down program counted its stored rows per (row, column block) in integer counters
    (acq_rel), and the program that stored a row's last pair summed its pairs in (split, pair) order (bitwise the
    combine's sums on Qwen3), but down slowed more than the combine launch cost: Qwen3 at M = 1 / 8 / 16 / 64 /
    256 / 1024 86.0 / 96.0 / 113.4 / 272.6 / 794.9 / 2947.1 -> 89.9 / 99.0 / 118.4 / 315.7 / 959.9 / 3518.6 (down
    alone 284 -> 525 at M = 256), Mixtral at M = 1 / 16 / 64 / 1024 196.3 / 224.9 / 429.4 / 4831.4 -> 197.8 /
    225.4 / 439.3 / 5175.0. H200, 2026-12-04, one run, graph us of the whole layer, best of three interleaved
    rounds, neither / wait_per_expert / both ("skewed": bench-kernel's even rows, experts drawn by lognormal
    popularity, sigma 0.7): Qwen3 at M = 1 / 4 / 8 / 16 97.5 / 100.8 / 104.6 / 115.5 -> 86.1 / 90.7 / 96.2 / 112.2
    / 85.6 / 89.9 / 94.3 / 112.0, skewed at M = 1 / 8 63.0 / 122.1 -> 58.9 / 115.0 / 58.5 / 114.1; at M = 64 / 256
    272.9 / 793.0 -> 274.6 / 796.1 / 276.2 / 803.6; Mixtral at M = 1 / 16 202.4 / 221.6 -> 196.7 / 222.4 / 210.2 /
    237.9, skewed at M = 1 172.3 -> 153.9 / 163.1. Every output bitwise equal to the first path's. So
    wait_per_expert by default, the per-pair wait not.
    Not kept either (H100, 2026-12-06, graph us of the whole layer, best of three interleaved rounds, every output
    bitwise equal; "skewed" as above, rows ascending): a down program asking L2 for its first 4 / 8 weight k-blocks
    and their scales (cp.async.bulk.prefetch.L2, one range per lane) before it waits for its expert's act tiles, so
    that they stream while gate_up's last programs run: slower at every M, the more so the more it asked. Qwen3 at M
    = 1 / 8 / 16 / 64 / 256 / 1024 114.0 / 119.9 / 127.5 / 229.6 / 721.9 / 2856.4 -> 118.8 / 125.3 / 131.2 / 236.9 /
    770.1 / 3007.2 (4 k-blocks) and 129.9 / 140.4 / 140.3 / 251.5 / 795.0 / 3098.3 (8), skewed at M = 1 / 8 / 64 71.8
    / 125.5 / 320.5 -> 76.9 / 134.7 / 332.1 and 81.7 / 145.3 / 341.0; Mixtral at M = 1 / 16 / 64 / 256 256.5 / 285.2
    / 405.4 / 1312.2 -> 256.9 / 288.0 / 442.9 / 1336.8 and 262.4 / 289.5 / 471.7 / 1367.9 (with down on 2 stages
    too, slower still). Nor (the next call, same GPU kind) a nanosleep of 200 / 1000 ns between the waiting
    program's polls of its counter: Qwen3 at M = 1 / 8 / 16 within 0.3 us (113.8 / 119.9 / 128.1), at M = 64 / 256
    229.8 / 717.8 -> 237.8 / 731.4 and 240.0 / 730.8, Mixtral at M = 16 283.9 -> 287.9 / 287.0.
    Tried the same day and not kept (Qwen3, graph us at M = 1 / 2 / 4 / 8 / 16, against 95.7 / 97.2 / 98.4 /
    103.1 / 113.6 in the same run): one program per (expert, column block) for each expert's first row block and
    row-block programs for the rest, 94.2 / 95.8 / 98.6 / 104.1 / 115.5, skewed (at most 5 / 8 / 20 / 39 / 116
    pairs on an expert at M = 1 / 2 / 4 / 8 / 16) 61.4 / 89.2 / 96.4 / 129.9 / 151.9 against 61.1 / 87.5 / 91.7 /
    118.8 / 148.9, 276.0 against 269.4 at M = 64; the weight loads with L2 evict_first, within 1.5 us at every M;
    (against 96.5 / 98.0 / 100.4 / 103.8 / 114.2) down loading its pair indices and router weights before its
    k-loop (142 registers against 128 on Triton 3.9) 97.7 / 98.4 / 101.4 / 104.0 / 115.6, 285.1 against 269.7 at
    M = 64; 64-column down tiles 96.6-119.7, on 1 warp 95.7 / 97.0 / 99.1 / 102.6 / 114.6, 32-column gate_up
    tiles 96.0-122.9, on 1 warp 97.0-123.9, both 96.4-128.7. Dequantizing each nibble quarter just before its MMA
    (four asm blocks) gave the same SASS as one block for all four (sm_90a, Triton 3.9): not timed.
    Decode on wgmma was slower (H200, 2026-12-03, Qwen3 whole layer, graph us at M = 1 / 8 / 16, for_load 103.2 /
    116.1 / 131.0): swap_ab + scale_weights on 4 warps at block_m 16 121.7 / 134.1 / 146.4; with 4 stages, 8 warps
    and 128-column gate_up blocks, 256-row down blocks, or the row-block grid 120-168; swap_ab alone (fp32 group
    partials, each quarter's wgmma waited on) 110.0 / 124.4 / 138.6; Mixtral 239-248 against 222-227 at M = 1-16.
    bf16_pair_rows: down writes each pair's router-weighted row in bf16, half the bytes to and from the combine, which
    adds them in fp32 as before: each pair's row is rounded once more (relative error up to 2^-9 per element), still no
    atomics, so still bitwise the same run to run. First measured with the combine on 256-column programs (Qwen3 917 /
    3430 against 950 / 3573 us at M = 256 / 1024, 297 against 299 at 64, 107.0 against 103.2 at 1) and not taken;
    with the combine on 1024-column programs (COMBINE_BLOCK_N) taken everywhere. H200, 2026-12-04, graph us of the
    whole Qwen3 layer, two interleaved rounds, fp32 pair rows on 256 columns -> bf16 on 1024: M = 8 96.0 / 101.2 ->
    94.6 / 96.5, 16 113.2 / 116.4 -> 109.4 / 112.0, 64 259.1 / 269.5 -> 243.5 / 249.8, 256 792.2 / 812.1 -> 758.3 /
    757.9, 1024 3081.2 / 3079.5 -> 3117.4 / 2956.1 (2048 columns on 8 warps 3008.4 / 2951.0; at this M the spread is
    wide: fp32 on 512-2048 columns 3094.8-3264.1, and the launches alone add up to 3089 -> 2868); down alone 37.7 / 42.1
    / 91.5 / 284.5 / 1161.7 -> 36.2 / 40.2 / 84.2 / 269.4 / 1063.3 at M = 8 / 16 / 64 / 256 / 1024. Error against the
    reference (max |out - ref| / max |ref|, the same random layer): 1.48e-3 -> 2.41e-3 at M = 16, 3.96e-3 -> 4.24e-3
    at 64, 4.34e-3 -> 4.67e-3 at 256; five calls bitwise equal both ways.

    Weight tiles through TMA (host tensor descriptors over w viewed as [rows, BK/4], one box per stored tile, the
    pipelined loop's loads becoming bulk copies on mbarriers) were measured and not kept (H100, 2026-12-05, two runs,
    graph us, best of three interleaved rounds; every output bitwise equal to today's): gate_up's at Qwen3 M = 64 /
    128 / 256 / 1024 135.2 / 205.6 / 397.0 / 1593.0 -> 135.0 / 205.3 / 396.9 / 1552.0 (the first run 137.5 -> 133.4
    at 64, 1607.1 -> 1501.7 at 1024), Mixtral within the rounds' spread (up to 6% between launches of the same
    gate_up); down's, 79.9 / 139.5 / 260.2 / 1011.7 -> 81.3 / 218.3 / 425.5 / 1629.1, and with its act rows also
    through TMA (contiguous at sorted positions) 93.6 / 202.5 / 392.6 / 1501.7. An ncu profile the same day (H100,
    Qwen3, M = 16 and 64) had found every GEMM launch latency-bound: about 3 warps per scheduler (register- and
    shared-memory-limited to 18.75% occupancy), under one eligible, a third of the stall at M = 64's gate_up at CTA
    barriers; TMA for the weights alone did not change that. Nor did Triton's automatic warp specialization
    (tl.range(warp_specialize=True), Triton 3.6, H100, 2026-12-05, graph us of each launch alone, best of three
    interleaved rounds, Qwen3): down's k-loop does not compile (make_ttgir: PassManager::run failed), its loads through
    pointers or through TMA; gate_up's multi-tile loop compiles and is bitwise the same but no faster, 143.7 / 417.2
    against 144.3 / 417.3 at M = 64 / 256, with its weights through TMA 146.1 / 419.7 against 144.2 / 419.6.

    The combine writes every row of the output (zeros for a row without pairs), so gate_up no longer zeroes it and the
    combine no longer waits for all of gate_up's programs (H100, 2026-12-06, one run, graph us of the whole layer, best
    of three interleaved rounds, the same change behind a flag; every output bitwise equal): Qwen3 at M = 1 / 2 / 4 / 8
    / 16 115.71 / 116.66 / 118.80 / 121.72 / 134.54 -> 115.38 / 116.41 / 118.33 / 121.01 / 133.00, at M = 64 239.3 /
    250.7 / 254.9 -> 248.8 / 251.5 / 249.6 (its rounds' spread); Mixtral at M = 1 / 8 263.52 / 266.19 -> 263.52 /
    265.52. Not kept, the same run: the routing's ranking programs asking L2 (prefetch.global.L2, inline PTX) for
    their expert's first gate_up k-block or two and its scales, once counted (or before counting), for all experts or
    the first 80 (those of gate_up's first wave), so that the weights stream while the routing runs: slower at every
    M, with L2::evict_last too. Qwen3 at M = 1 / 8 / 16 116.2-117.5 / 121.9-123.0 / 135.4-136.2 against 115.7 / 121.7 /
    134.5 (the routing alone 1-2 us slower), Mixtral 269-277 against 263.5 at M = 1 (the routing 8-16 us slower: a
    k-block of its gate_up is 1.8 MB an expert).

    Decode (<= 16 pairs per expert), H200, Qwen3-30B-A3B shapes, graph time at 1 / 8 tokens per
    expert (bench_kernel --sweep, two runs, 2026-11-29): this default 101-102 / 108-111 us; 4 stages
    105 / 113, 5 stages 109 / 118, 2 stages 119 / 128; down tiles of 64 rows 111 / 120, of 256 rows
    with 8 warps 107 / 114; gate_up tiles of 32 rows 118 / 127, of 128 rows with 8 warps 108 / 116;
    8 warps 128 / 135; block_k 64 124 / 132; Triton instead of PTX dequant 147 / 152; block_m 32
    140 / 145 but 320 against 435 us at 64 tokens per expert (hence rows of 32 above 16). Programs
    streaming 2 to 8 row tiles back to back in one flattened loop measured 104-120 / 108-125 us.
    """

    block_m: int = 16
    block_n_gate_up: int = 64
    block_n_down: int = 128
    num_warps: int = 4
    num_stages: int = 3
    ptx_dequant: bool = True  # CUDA only: PTX nibble unpacking (kernels/triton_w4a16.py)
    block_k: int = 128
    num_warps_down: int | None = None
    num_stages_down: int | None = None
    block_m_down: int | None = None
    swap_ab_down: bool | None = None
    swap_ab: bool = False
    scale_weights: bool = False
    group_m: int = 8
    tile_n_gate_up: int = 64
    tile_n_down: int = 128
    expert_grid: bool = False
    wait_per_expert: bool = True
    split_k: int = 1
    dependent_launch: bool = True  # CUDA sm_90+ only: gate_up, down and combine start under the launch before
    tiles_gate_up: int = 1
    bf16_pair_rows: bool = True  # down's router-weighted pair rows in bf16 (False: fp32), summed by the combine in fp32

    def __post_init__(self) -> None:
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, not {self.split_k}")
        if self.block_k not in BLOCK_KS:
            raise ValueError(f"block_k must be one of {BLOCK_KS}, not {self.block_k}")
        if self.block_m < (8 if self.swap_ab else 16) or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16 (>= 8 with swap_ab), not {self.block_m}")
        if self.block_m_down is not None or self.swap_ab_down is not None:
            self.for_down()  # validates down's block_m and swap_ab
        for block, tile in ((self.block_n_gate_up, self.tile_n_gate_up), (self.block_n_down, self.tile_n_down)):
            if tile < 16 or tile & (tile - 1) or block % tile or block & (block - 1):
                raise ValueError(f"block_n {block} must be a power-of-two multiple of its tile {tile} (>= 16)")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, not {self.group_m}")
        if self.tiles_gate_up > 1 and self.expert_grid:
            raise ValueError("tiles_gate_up > 1 needs the row-block grid")

    def for_down(self) -> TritonConfig:
        """The configuration down launches with: block_m, swap_ab, num_warps and num_stages as down takes them."""
        return replace(self, block_m=self.block_m_down or self.block_m, block_m_down=None,
                       swap_ab=self.swap_ab if self.swap_ab_down is None else self.swap_ab_down, swap_ab_down=None,
                       num_warps=self.num_warps_down or self.num_warps, num_warps_down=None,
                       num_stages=self.num_stages_down or self.num_stages, num_stages_down=None)

    @classmethod
    def for_load(cls, num_pairs: int, num_experts: int, amd: bool = False) -> TritonConfig:
        """The configuration for the load: on AMD GPUs (amd) for_gfx11's, else the fastest configuration
        bench_kernel --sweep measured (H200, Triton 3.6, 2026-12-02, commit 4344a33, graph time per
        tokens-per-expert M):

        With down's per-expert wait (H200, 2026-12-04, `bench_kernel --models qwen3-30b-a3b --tokens 1,8,16 --sweep`,
        benchmarks/results/2026-12-04c-h200-bench_kernel-sweep.json, graph us at M = 1 / 8 / 16) the choices below
        are still Qwen3's fastest of their neighbours: 86.9 / 96.0 / 113.2; gate_up blocks of 128 columns 94.7 /
        101.9 / 121.9, 4 stages 89.0 / 99.8 / 117.8, main's grid 91.3 / 98.6 / 116.9, down on 2 warps 94.0 / 102.8 /
        121.7, down's k-blocks split in 2 92.4 / 106.2 / 131.4, 256-column down tiles on 8 warps 99.3 / 110.7 /
        124.3; at M = 16 swapped 16-row blocks 114.6.

        up to 8 pairs per expert (H200, 2026-12-04, graph us of the whole layer, best of three interleaved rounds;
        "skewed": rows pick their top-k with lognormal expert popularity (sigma 0.7), at most 7 / 12 / 18 / 31 pairs
        on one of Qwen3's experts at M = 1 / 2 / 4 / 8): 8-row blocks with x as the MMA's 8-wide operand (swap_ab)
        on the row-block grid. Qwen3 before -> with it at M = 1 / 2 / 4 / 8, 102.1 / 102.7 / 103.8 / 106.6 -> 95.3 /
        96.8 / 98.7 / 102.3 (at M = 1 gate_up 62.4 -> 59.3, down 36.5 -> 33.3); skewed 87.1 / 97.2 / 121.6 / 139.1
        -> 63.8 / 85.2 / 97.0 / 119.2. The same blocks on main's grid (expert_grid) were faster on the even load,
        91.7 / 93.2 / 95.3 / 99.0 (80.2% of copy at M = 1), but slower skewed, 71.9 / 92.7 / 120.6 / 172.1: a program
        walks its expert's rows 8 at a time, every 8 rows one more pass over the weights; not taken. On the row-block
        grid group_m 1 / 128 gave 95.1-102.5 / 96.1-103.7 even and 63.4-119.7 / 65.6-129.6 skewed. Earlier the same
        day, on main's grid: 4 stages 93.4 / 101.3 at M = 1 / 8 against 91.8 / 99.4, down on 4 stages 91.2 / 99.4,
        down on 1 warp 91.4 / 100.3, gate_up on 1 warp 99.6 / 105.9; swap_ab at 16 rows 101.0-114.1 against
        102.1-113.4 at M = 1-16 (n16: no less tensor work); 8-row blocks at M = 16 (two per expert) 154.3 against
        113.6. Mixtral: gate_up on those blocks with group_m 1, down unchanged (block_m_down 16, unswapped), at M =
        1 / 2 / 4 / 8 209.7 / 209.3 / 213.2 / 215.5 -> 200.3 / 203.2 / 203.0 / 205.8 (gate_up at M = 1 135.3 ->
        126.2), skewed at M = 2 / 8 (at most 7 / 22 pairs on an expert) 212.1 / 297.6 -> 180.4 / 259.1 (group_m 8:
        196.3 / 270.9), but 230.7 -> 321.1 at M = 16; down too on swapped 8-row blocks was slower, 4 warps (wgmma)
        218.4 / 221.1 / 223.8 at M = 1 / 4 / 8 against 208.2 / 209.9 / 216.7 (down 72.9 -> 81.3 at M = 8), 2 warps
        231.7 / 233.8 / 237.3.

        decode (M <= 16), re-measured per launch on the branch kernels-decode (2026-12-02, graph us of
        gate_up and down alone, at M = 1 / 4 / 16): gate_up with 2 warps (3 stages, 64-column blocks) took
        134.7 / 135.8 / 143.5 (Mixtral) and 62.8 / 63.0 / 64.6 (Qwen3) against 4 warps' 141.2 / 142.4 / 148.5
        and 64.9 / 65.8 / 70.4; 1 warp, 2 / 4 / 5 stages or 128 / 256 columns were slower. Down: few large
        experts (Mixtral, 256 programs of 112 k-blocks without a split) with the k-blocks split in 2, 4
        warps, 4 stages: 70.7 / 71.3 / 75.0 against 77.0 / 77.3 / 89.9 (4 stages; at 16 tiles of 256 rows
        with 8 warps); a split in 4 72.4 / 73.0 / 77.4. Many small experts (Qwen3, 6 k-blocks) with 2 warps
        and 4 stages: 36.7 / 37.8 / 42.9 against 37.4 / 38.3 / 46.2; splitting k there cost 10-25 us.
        The whole layer (graph us at M = 1 / 2 / 4 / 8 / 16, before -> with these): Mixtral 220.8 / 221.6 /
        222.7 / 226.3 / 242.6 -> 209.5 / 210.8 / 210.5 / 215.0 / 223.0; Qwen3 126.6 -> 120.7 at 8 and
        139.1 -> 132.0 at 16, but 106.4 / 109.7 / 113.5 -> 109.0 / 110.5 / 113.6 at 1 / 2 / 4, so up to
        M = 4 many small experts kept 4 warps.
        With dependent launches (same date, whole layer, graph us, one run), many small experts take 2 warps
        at every decode M and down's 3 stages: at M = 1 / 2 / 4 2 warps 104.0 / 104.8 / 107.7 against 4
        warps' 106.1 / 108.8 / 111.7; at M = 8 / 16 down on 3 stages 115.6 / 130.5 against 4 stages' 120.2 /
        133.1 (an earlier run: 119.7 / 128.6 against 122.1 / 131.0).
        Before (same date, commit 4344a33): few large experts: 4 stages, 1-2% faster at M = 1-8; at
        M = 16 down tiles of 256 rows with 8 warps, 246 against 265 us. Many small experts (Qwen3,
        E = 128): this default, and up to M = 8 (until 2026-12-04) on main's grid (expert_grid): the row-block grid
        (commit c827664, routing ranked or counted) took 116 / 154 / 147 / 150 us at M = 1 / 2 / 4 /
        8 against main's layer's 107 / 110 / 116 / 130 (2026-12-02; at M = 1 gate_up 66.0, down
        40.1 us), but 139 against 158 at M = 16. Mixtral's decode on the row-block grid was at or
        below main's (M = 1 226, M = 16 250 us).
        16 < M < 48: rows of 32 (not measured since 2026-11-29). M >= 48: the weights as the left
        operand with the scales on them. Blocks of 128 rows above M = 64 (then both cover an
        expert's rows with the same padding, and 128 is faster: Mixtral 695 against 847 us at M =
        128, Qwen3 517 against 540; 1452/1729 and 954/1009 at 256); 64 rows up to 64 (128 rows:
        700 against 433 us, 667 against 521). At 64 rows, few large experts take gate_up tiles of
        128 columns with 8 warps (433 against 518 us), many small ones 64 with 4 (521 against 531), two
        column blocks per gate_up program since 2026-12-04 (tiles_gate_up, figures in the class docstring).
        Since 2026-12-05 (evening, H200, graph us of the whole layer, best of three interleaved rounds, outputs
        bitwise the same) many small experts above M = 64 take down's 256 columns on 8 warps again, as few large
        ones do: Qwen3 at M = 128 / 256 / 1024 384.5 / 723.2 / 2856.0 -> 376.7 / 711.2 / 2775.0 (256 columns on 4
        warps: 1256 / 2441 / 9293). The paragraph below chose 128 columns on 4 warps for them, on the kernels of
        that day (fp32 pair rows, rows sorted on the GPU). At M = 48-64 they keep 128 columns on 4 warps (H100,
        2026-12-06, graph us, best of five interleaved rounds, layer / gate_up / down, outputs bitwise the same):
        at M = 64 225.2 / 135.1 / 80.5 against 256 columns on 8 warps 239.1 / 134.1 / 91.1 (2 / 4 stages 264.5 /
        241.0, group_m 1 241.8, with 128-column gate_up blocks on 8 warps 244.6), 128 columns on 4 stages 244.6;
        at M = 48 217.9 / 133.8 / 78.7 against 232.6-251.9.
        Down's column blocks from M = 48 (2026-12-03 afternoon, H200, three interleaved rounds, graph us of down
        alone and of the whole layer): many small experts above M = 64 take 128 columns on 4 warps (down 162 /
        306 / 1148-1211 -> 150 / 281 / 1056-1086 at M = 128 / 256 / 1024, layer 439-441 / 810-812 / 2988-3040 ->
        428-429 / 784-788 / 2941-3010), no longer 256 columns on 8 warps (which had beaten 128 on 8 warps the
        morning before: 893 / 3336 against 950 / 3573 at M = 256 / 1024); few large experts from M = 48 take 256
        columns on 8 warps (down 177 -> 151 at M = 64, 1976-2131 -> 1818-1945 at 1024; layer 450.5-451.2 ->
        424.1-424.7 at 64, 658-682 -> 628-651 at 128, 1300-1392 -> 1241-1340 at 256, 5493-5568 -> 5244-5433
        at 1024). Not taken (down alone, Qwen3 at M = 256 / 1024 against 306 / 1148-1211): 2 / 4 stages 353 /
        1331, 308 / 1175; 128 columns on 8 warps 364 / 1381 (2 stages 443 / 1661), on 4 warps with 2 / 4
        stages 309 / 1151, 438 / 1699; down's own 64-row blocks on 8 / 4 warps 392 / 1499, 403 / 1518 (with
        128 columns on 4 warps 302 / 1185, with 4 stages 401 / 1552); 256-row down blocks, 128 columns, 8 warps
        290 / 1087-1108 (2 stages 339 / 1247); gate_up too on 4 warps and 64 columns, layer 797-799 /
        2968-3096 against 784-788 / 2941-3010; gate_up on 4 stages 792-793 / 2999-3025. Qwen3 at M = 64
        (layer 281.7-282.0): down on 2 / 4 stages 317.5 / 301.3, on 8 warps 338.9, 32-row down blocks 297.1
        (256 columns, 8 warps 305.9), gate_up on 2 / 4 stages 295.4 / 311.8, on 128 columns 281.4. Mixtral at
        M = 1024 against 256 columns' 5244-5433: 4 stages 5237-5380, with gate_up on 4 stages 5282-5349, 128
        columns on 4 warps 5414-5557. Qwen3's decode on 256-column down blocks, 4 / 2 warps: 104.4 / 109.9 at
        M = 1, 109.8 / 116.5 at 8, 115.8 / 119.4 at 16 against 101.8-102.2 / 106.9 / 113.7-113.8.
        """
        per_expert = -(-num_pairs // num_experts)
        few = num_experts <= FEW_EXPERTS
        if amd:
            return cls.for_gfx11(per_expert, few)
        if per_expert <= 8:
            if few:
                return cls(block_m=8, swap_ab=True, num_warps=2, group_m=1, block_m_down=16, swap_ab_down=False,
                           num_warps_down=4, num_stages_down=4, split_k=2)
            return cls(block_m=8, swap_ab=True, num_warps=2)
        if per_expert <= 16:
            if few:
                return cls(num_warps=2, num_warps_down=4, num_stages_down=4, split_k=2)
            return cls(num_warps=2)
        if per_expert < 48:
            return cls(block_m=32)
        if per_expert > 64:
            return cls(block_m=128, block_n_gate_up=128, block_n_down=256, num_warps=8, swap_ab=True, scale_weights=True)
        if few:
            return cls(block_m=64, block_n_gate_up=128, block_n_down=256, num_warps=8, swap_ab=True, scale_weights=True)
        return cls(block_m=64, swap_ab=True, scale_weights=True, tiles_gate_up=2)

    @classmethod
    def for_gfx11(cls, per_expert: int, few: bool) -> TritonConfig:
        """AMD RDNA3 (gfx11), chosen by the ISA alone and never timed (no AMD GPU here): configurations like
        for_load's that compile without scratch for gfx1100 with Triton 3.9's AMD backend (the tests' Triton;
        python -m kernels.triton_isa, run by tests/kernels/test_triton_isa.py) and with 3.6's (the GPU machine's).
        Every configuration for_load takes on NVIDIA spills there in gate_up or down (2026-12-06, Triton 3.9, bytes
        of scratch per lane, gate_up / down, at 256 VGPRs): 8-row swapped blocks at M <= 8 712 / 384 (236 / 192 at
        best over 2-4 warps and 1-3 stages; x is an 8-wide operand that WMMA's 16 x 16 x 16 pads anyway); 16 rows
        on 2 warps and 3 stages 52 / 0 (few experts: down on 4 warps and 4 stages 24); 32 rows 164 / 92; 64 rows
        1868 / 512 (few experts 1780 / 364); 128 rows 3212 / 1416. Taken, with 2 stages (ROCm's guidance for a
        GEMM's loop): up to M = 16 16-row blocks on 4 warps (VGPRs gate_up / down 229 / 200 on Triton 3.9, 232 / 246
        on 3.6; on 2 warps 239 / 246 on 3.9 but 224 / 168 bytes of scratch on 3.6), few experts with down's k-blocks
        split in two as on NVIDIA (229 / 200, 232 / 246); above, 32-row blocks on 8 warps (229 / 185, 227 / 242; on
        4 warps down spills on both). Of the wider blocks tried only 64 swapped rows without pipelining (1 stage, 8
        warps) spilled on neither (237 / 141, 227 / 191). Measure them with bench_kernel --sweep on the GPU before
        trusting a speed."""
        if per_expert <= 16:
            if few:
                return cls(num_warps=4, num_stages=2, split_k=2)
            return cls(num_warps=4, num_stages=2)
        return cls(block_m=32, num_warps=8, num_stages=2)


class TritonBackend(ExpertBackend):
    name = "triton"

    def supports_device(self, device: torch.device) -> Support:
        if device.type != "cuda":
            return Support.no(f"device {device} is not a CUDA/ROCm GPU")
        if importlib.util.find_spec("triton") is None:
            return Support.no("triton is not installed")
        if not torch.cuda.is_available():
            return Support.no("torch sees no GPU")
        if is_rocm(device):
            with torch.cuda.device(device):
                if reason := compile_refusal(device):
                    return Support.no(reason)
        return Support.yes()

    def supports_quant_scheme(self, scheme: QuantScheme) -> Support:
        return symmetric_int4_support(scheme, GROUP_SIZES)

    def prepare(self, weights: W4A16ExpertWeights, activation: str, device: torch.device) -> PreparedExperts:
        return TritonExperts(weights, activation, device)


@dataclass(frozen=True, slots=True)
class Routes:
    """The pairs in two stable orders (ties keep pair order), both on the device.

    By expert (position s): expert e owns s in [bounds[e], bounds[e+1]); rows, router and pairs
    give each position's row, fp32 router weight and pair index. By row (position j): crows and
    cpairs, sorted by (row, pair index), the order combine_kernel adds a row's pairs in; row t owns
    j in [row_bounds[t], row_bounds[t+1]). cpairs None: the rows were given in ascending order, so
    pair order is that order (crows: the given rows, position j: pair j).
    """

    bounds: torch.Tensor  # [E+1] int32, a strided view (kernels take its stride)
    rows: torch.Tensor  # [P] int32
    router: torch.Tensor  # [P] fp32
    pairs: torch.Tensor  # [P] int32
    crows: torch.Tensor  # [P] int32 (the given rows where cpairs is None)
    cpairs: torch.Tensor | None  # [P] int32
    row_bounds: torch.Tensor  # [T+1] int32, a strided view
    ready: torch.Tensor  # [E] int32, zeroed by the routing: gate_up's finished act tiles per expert


@dataclass(frozen=True, slots=True)
class TritonProjection:
    """w [E, Np/BN, Kp/BK, BN, BK/4] int16 tiles, s [E, Kp/G, Np] fp32 (kernels/triton_w4a16.py).

    Np, Kp: N, K rounded up to block_n, block_k (`parts` > 1: each of that many equal row ranges,
    gate and up, padded separately); padded weights are 0 with scale 0.
    The scales stay fp32 even where a checkpoint's are 16-bit. Stored in bf16 (the same values, the
    layer's bytes 3% fewer at group 128), the kernels were slower (H200, Triton 3.6, 2026-12-05, graph
    us, best of three interleaved rounds, bench_kernel's layers with bf16-exact scales): Qwen3 at M = 1 /
    8 / 64 / 1024 85.8 / 93.8 / 244.0 / 2837 -> 97.5 / 99.5 / 263.0 / 2976, Mixtral at M = 1 / 64
    197.6 / 407.0 -> 221.4 / 577.2; why (the 2-byte loads of a [BN] scale vector not pipelined?), not
    established.
    """

    w: torch.Tensor
    s: torch.Tensor
    group_size: int
    block_k: int
    block_n: int
    padded_rows: int  # rows of one part after padding

    @classmethod
    def from_int4(
        cls, weights: Int4Weights, device: torch.device, block_k: int = 128, block_n: int = 64, parts: int = 1,
    ) -> TritonProjection:
        assert block_k in BLOCK_KS, f"block_k must be one of {BLOCK_KS}"
        g, k, n = weights.group_size, weights.in_features, weights.out_features // parts
        q_cols = block_k // 4
        assert g >= q_cols and g % q_cols == 0, f"group {g} is smaller than a quarter block {q_cols}"
        kp, np_ = _cdiv(k, block_k) * block_k, _cdiv(n, block_n) * block_n
        tiles = []
        for e in range(weights.num_experts):
            q = unpack_int4(weights.packed[e].to(device)).to(torch.int32)  # [parts*N, K]
            q = torch.nn.functional.pad(q.unflatten(0, (parts, n)), (0, kp - k, 0, np_ - n))  # [parts, Np, Kp]
            q = q.unflatten(-1, (kp // block_k, 4, q_cols))  # [parts, Np, Kp/BK, 4, Q]
            word = q[..., 0, :] | (q[..., 1, :] << 4) | (q[..., 2, :] << 8) | (q[..., 3, :] << 12)
            word = torch.where(word >= 1 << 15, word - (1 << 16), word).to(torch.int16)  # [parts, Np, Kp/BK, Q]
            word = word.unflatten(1, (np_ // block_n, block_n)).permute(0, 1, 3, 2, 4)  # [parts, Np/BN, Kp/BK, BN, Q]
            tiles.append(word.flatten(0, 1).contiguous())
        scales = weights.scales.to(device=device, dtype=torch.float32).unflatten(1, (parts, n))  # [E, parts, N, K/G]
        scales = torch.nn.functional.pad(scales, (0, kp // g - k // g, 0, np_ - n))  # kp % g == 0
        scales = scales.flatten(1, 2).transpose(1, 2).contiguous()  # [E, Kp/G, parts*Np]
        return cls(torch.stack(tiles), scales, g, block_k, block_n, np_)


class TritonExperts(PreparedExperts):
    def __init__(
        self, weights: W4A16ExpertWeights, activation: str, device: torch.device,
        config: TritonConfig | None = None, amd: bool | None = None,
    ) -> None:
        """config: launch every call with it (else for_load's for each call's load); amd: take AMD's
        configurations (default: whether `device` is a ROCm GPU; kernels.triton_isa compiles them for gfx11 on
        the CPU)."""
        from kernels import triton_w4a16  # imports triton: only once a GPU layer is prepared

        self.kernels = triton_w4a16
        self.amd = is_rocm(device) if amd is None else amd
        self.activation = ACTIVATION_CODES[activation]
        self.num_experts = weights.num_experts
        self.hidden_size = weights.hidden_size
        self.intermediate_size = weights.intermediate_size
        layout = config or TritonConfig()  # for_load's configurations use the default tiles
        self.w13 = TritonProjection.from_int4(weights.w13, device, layout.block_k, layout.tile_n_gate_up, parts=2)
        self.w2 = TritonProjection.from_int4(weights.w2, device, layout.block_k, layout.tile_n_down)
        self.config = config

    def configured(self, config: TritonConfig) -> TritonExperts:
        """The same packed weights launched with `config` (which must share their tiles), e.g. for a sweep."""
        layout = self.config or TritonConfig()
        assert (config.block_k, config.tile_n_gate_up, config.tile_n_down) == (
            layout.block_k, layout.tile_n_gate_up, layout.tile_n_down), "config needs other weight tiles"
        other = copy.copy(self)
        other.config = config
        return other

    def config_for(self, num_pairs: int) -> TritonConfig:
        """The configuration a call with num_pairs pairs launches with."""
        return self.config or TritonConfig.for_load(num_pairs, self.num_experts, self.amd)

    def route(self, pair_rows, pair_experts, pair_weights, num_rows: int, rows_ascending: bool = False) -> Routes:
        """Pairs grouped by expert and by row (rows in [0, num_rows)), both stable.

        Up to ROUTE_SCAN_MAX_WORK (experts + rows) x pairs: one launch ranks them (scan_route_kernel;
        a program per few experts or rows). Else stable counting sorts, O(P) work in count / cumsum / scatter
        launches: the first pass by expert and by the row's low digit at once (the whole row up to
        WHOLE_ROW_BITS bits), then LSD passes of up to RADIX_BITS bits for the rest of the row, and a
        binary search for the row bounds.
        rows_ascending (the caller's promise that pair_rows never decrease): the rows are not sorted, each pair
        stores the starts of the rows that begin at it (in the first launch); the experts are ranked up to
        ROUTE_SCAN_MAX_PAIRS_ASCENDING pairs, else counted by chunks of pairs in two launches (_route_chunks).
        """
        e, p, dev = self.num_experts, pair_rows.numel(), pair_rows.device
        pairs, rows = (torch.empty(p, dtype=torch.int32, device=dev) for _ in range(2))
        if rows_ascending:
            crows, cpairs = pair_rows, None
        else:
            crows, cpairs = (torch.empty(p, dtype=torch.int32, device=dev) for _ in range(2))
        router = torch.empty(p, dtype=torch.float32, device=dev)
        ready = torch.empty(e, dtype=torch.int32, device=dev)  # zeroed by the first routing launch
        if rows_ascending:
            ranked = p <= ROUTE_SCAN_MAX_PAIRS_ASCENDING
        else:
            ranked = (e + num_rows) * p <= ROUTE_SCAN_MAX_WORK
        if ranked:
            ranked_rows = 0 if rows_ascending else num_rows  # rows ranked beside the experts
            keys = 1
            while _cdiv(e, keys) + _cdiv(ranked_rows, keys) > ROUTE_SCAN_PROGRAMS:
                keys *= 2
            bounds = torch.empty(e + 1, dtype=torch.int32, device=dev)
            row_bounds = torch.empty(num_rows + 1, dtype=torch.int32, device=dev)
            row_keys, row_programs = ((ROW_BOUNDS_BLOCK, _cdiv(p + 1, ROW_BOUNDS_BLOCK)) if rows_ascending
                                      else (keys, _cdiv(num_rows, keys)))  # fmt: skip
            self.kernels.scan_route_kernel[(_cdiv(e, keys) + row_programs,)](
                pair_experts, pair_rows, pair_weights, p, e, num_rows, bounds, rows, router, pairs,
                crows, pairs if cpairs is None else cpairs, row_bounds, ready,
                BLOCK_P=max(16, min(_next_pow2(p), ROUTE_SCAN_ELEMENTS // keys)), KEYS=keys, READY_BLOCK=READY_BLOCK,
                ROWS_ASCENDING=rows_ascending, ROW_KEYS=row_keys, USE_GDC=has_dependent_launch(dev),
                num_warps=ROUTE_SCAN_WARPS if rows_ascending else 4,
            )
            return Routes(bounds, rows, router, pairs, crows, cpairs, row_bounds, ready)
        expert_digits = max(2, _next_pow2(e))
        if rows_ascending:
            bounds, row_bounds = self._route_chunks(pair_rows, pair_experts, pair_weights, num_rows, expert_digits,
                                                    rows, router, pairs, ready)
            return Routes(bounds, rows, router, pairs, crows, cpairs, row_bounds, ready)
        row_bits = max(1, (num_rows - 1).bit_length())
        row_digits = max(2, 1 << (row_bits if row_bits <= WHOLE_ROW_BITS else RADIX_BITS))
        digits = max(expert_digits, row_digits)  # of the wider order
        block_p, blocks = self._blocks(p, digits)
        counts = torch.empty(2, 1 + digits * blocks, dtype=torch.int32, device=dev)
        self.kernels.route_count_kernel[(blocks,)](
            pair_experts, pair_rows, p, counts, counts.stride(0), blocks, ready, e,
            BLOCK_P=block_p, EXPERT_DIGITS=expert_digits, NUM_DIGITS=row_digits, READY_BLOCK=READY_BLOCK,
        )
        # Integer cumsums (the same sums in any order), a 1-D scan per order over its own digits' counts: torch's scan
        # along the rows of the [2, N] tensor took 330 us against 11 for two 1-D scans at N = 262145 (Qwen3, M = 1024;
        # H200, 2026-12-03). The experts count and scan their own digits, not the rows' (H200, 2026-12-04, graph us of
        # the routing alone, best of three interleaved rounds, Qwen3 at M = 64 / 128 / 256 / 1024: 25.9 / 36.7 / 40.1 /
        # 78.1 -> 19.9 / 35.6 / 39.2 / 73.6, the layer at M = 64 272.2 -> 267.0; Mixtral at M = 256 / 1024 10.4 /
        # 34.7 -> 10.5 / 32.6).
        starts = torch.empty_like(counts)
        for order, used in enumerate((1 + expert_digits * blocks, 1 + row_digits * blocks)):
            torch.cumsum(counts[order, :used], 0, dtype=torch.int32, out=starts[order, :used])
        self.kernels.route_scatter_kernel[(blocks,)](
            pair_experts, pair_rows, pair_weights, p, starts, starts.stride(0), blocks,
            rows, router, pairs, crows, cpairs, BLOCK_P=block_p,
            BLOCK_C=ROUTE_COMPARE_BLOCK, EXPERT_DIGITS=expert_digits, NUM_DIGITS=row_digits,
            USE_GDC=has_dependent_launch(dev),
        )
        bounds = starts[0, ::blocks][: e + 1]  # [E+1] int32, strided: expert d's run starts at block 0's start
        done = row_digits.bit_length() - 1  # row bits the first pass sorted by
        passes = _cdiv(max(0, row_bits - done), RADIX_BITS)
        width = _cdiv(row_bits - done, passes) if passes else 0
        if not passes:  # the first pass sorted whole rows: its row-digit starts are the row starts
            return Routes(bounds, rows, router, pairs, crows, cpairs, starts[1, ::blocks][: num_rows + 1], ready)
        for i in range(passes):
            crows, cpairs = self._row_pass(crows, cpairs, done + i * width, 1 << width)
        return Routes(bounds, rows, router, pairs, crows, cpairs, self._row_bounds(crows, num_rows), ready)

    def _route_chunks(self, pair_rows, pair_experts, pair_weights, num_rows, expert_digits, rows, router, pairs, ready):
        """Ascending rows counted by expert in two launches over chunks of pairs (chunk_count_kernel,
        chunk_place_kernel), which also store the row bounds and zero `ready`: -> (bounds [E+1], row_bounds [T+1])."""
        e, p, dev = self.num_experts, pair_rows.numel(), pair_rows.device
        chunk = min(ROUTE_CHUNK_MAX, max(ROUTE_CHUNK_MIN, _next_pow2(_cdiv(p, ROUTE_CHUNKS))))
        chunks = _cdiv(p, chunk)
        counts = torch.empty(chunks, expert_digits, dtype=torch.int32, device=dev)
        bounds = torch.empty(e + 1, dtype=torch.int32, device=dev)
        row_bounds = torch.empty(num_rows + 1, dtype=torch.int32, device=dev)
        gdc = has_dependent_launch(dev)
        self.kernels.chunk_count_kernel[(chunks,)](
            pair_experts, pair_rows, p, num_rows, counts, row_bounds, ready, e,
            CHUNK=chunk, EXPERT_DIGITS=expert_digits, READY_BLOCK=READY_BLOCK, USE_GDC=gdc, num_warps=ROUTE_CHUNK_WARPS,
        )
        self.kernels.chunk_place_kernel[(chunks,)](
            pair_experts, pair_rows, pair_weights, p, e, counts, chunks, bounds, rows, router, pairs,
            CHUNK=chunk, EXPERT_DIGITS=expert_digits, COUNT_ROWS=max(1, ROUTE_COUNT_ELEMENTS // expert_digits),
            USE_GDC=gdc, num_warps=ROUTE_CHUNK_WARPS, **({"launch_pdl": True} if gdc else {}),
        )
        return bounds, row_bounds

    def _row_bounds(self, crows: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[num_rows + 1] int32: each row's first position in crows [P] (ascending), by a binary search per row."""
        p = crows.numel()
        row_bounds = torch.empty(num_rows + 1, dtype=torch.int32, device=crows.device)
        self.kernels.row_bounds_kernel[(_cdiv(num_rows + 1, ROW_BOUNDS_BLOCK),)](
            crows, p, num_rows, p.bit_length(), row_bounds, BLOCK_T=ROW_BOUNDS_BLOCK,
            USE_GDC=has_dependent_launch(crows.device), num_warps=4,
        )
        return row_bounds

    @staticmethod
    def _blocks(p: int, digits: int) -> tuple[int, int]:
        """(pairs per counting program, programs): a [block, digits] comparison stays <= 32K elements."""
        block_p = min(256, max(16, 32768 // digits))
        return block_p, _cdiv(p, block_p)

    def _row_pass(self, crows, cpairs, shift, digits):
        """One stable counting pass of (row, pair) order on digit (row >> shift) % digits -> (crows, cpairs)."""
        p = crows.numel()
        block_p, blocks = self._blocks(p, digits)
        counts = torch.empty(1 + digits * blocks, dtype=torch.int32, device=crows.device)
        self.kernels.digit_count_kernel[(blocks,)](crows, p, shift, counts, blocks, BLOCK_P=block_p, NUM_DIGITS=digits)
        starts = torch.cumsum(counts, 0, dtype=torch.int32)
        rows_out, pairs_out = torch.empty_like(crows), torch.empty_like(cpairs)
        self.kernels.digit_scatter_kernel[(blocks,)](
            crows, cpairs, p, shift, starts, blocks, pairs_out, rows_out,
            BLOCK_P=block_p, BLOCK_C=ROUTE_COMPARE_BLOCK, NUM_DIGITS=digits,
        )
        return rows_out, pairs_out

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights, *, rows_ascending: bool = False) -> torch.Tensor:
        x = hidden if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.to(torch.bfloat16)
        x = x.contiguous()  # [T, H]
        num_pairs = pair_rows.numel()
        if num_pairs == 0:
            return torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        cfg = self.config_for(num_pairs)
        routes = self.route(pair_rows, pair_experts, pair_weights, x.shape[0], rows_ascending)
        return self.combine(self.down(self.gate_up(x, routes, cfg), routes, cfg), routes, cfg)

    def _row_blocks(self, num_pairs: int, cfg: TritonConfig) -> int:
        """An upper bound on the BLOCK_M-row blocks of all experts: one partial block per expert, each
        block holds a pair (grid slots past the real blocks exit at once)."""
        return min(num_pairs, _cdiv(num_pairs, cfg.block_m) + self.num_experts)

    def _gate_up_grid(self, num_pairs: int, cfg: TritonConfig) -> tuple[int, int, int]:
        """gate_up's (column blocks, row blocks, programs)."""
        num_n, num_m = _cdiv(self.w13.padded_rows, cfg.block_n_gate_up), self._row_blocks(num_pairs, cfg)
        programs = num_n // _tiles(num_n, cfg.tiles_gate_up) * (self.num_experts if cfg.expert_grid else num_m)
        return num_n, num_m, programs

    def gate_up(self, x, routes: Routes, cfg: TritonConfig) -> torch.Tensor:
        """-> act [P, I] in x's dtype (sorted positions). Counts its finished act tiles in routes.ready (down waits
        on those)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        act = torch.empty(routes.rows.numel(), i, dtype=x.dtype, device=x.device)  # [P, I]
        w13 = self.w13
        num_n, num_m, programs = self._gate_up_grid(act.shape[0], cfg)
        self.kernels.gate_up_kernel[(programs,)](
            x, x.stride(0),
            routes.rows, routes.bounds, routes.bounds.stride(0),
            w13.w, w13.w.stride(0), w13.w.stride(1),
            w13.s, w13.s.stride(0), w13.s.stride(1),
            act, act.stride(0), routes.ready,
            num_n, num_m, e, i, w13.padded_rows, h,
            GROUP=w13.group_size, BLOCK_K=w13.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up,
            TILE_N=w13.block_n, GROUP_M=cfg.group_m, BLOCK_E=_expert_slots(e),
            ACTIVATION=self.activation, IS_BF16=x.dtype == torch.bfloat16, USE_PTX=_use_ptx(cfg, x),
            SWAP_AB=cfg.swap_ab, SCALE_W=cfg.scale_weights, EVEN_K=h % w13.block_k == 0,
            EVEN_N=w13.padded_rows % cfg.block_n_gate_up == 0,
            NUM_STAGES=cfg.num_stages, EXPERT_GRID=cfg.expert_grid,
            LATE_DEPENDENTS=cfg.wait_per_expert, TILES=_tiles(num_n, cfg.tiles_gate_up),
            **_launch_options(cfg, x, cfg.num_warps),
        )
        return act

    def down(self, act, routes: Routes, cfg: TritonConfig) -> torch.Tensor:
        """-> [split_k, P, H] bf16 (fp32 unless bf16_pair_rows): row p of slice s is pair p's router * (act @ w2^T)
        over split s's k-blocks.
        wait_per_expert: each program waits for its expert's act tiles in routes.ready, so gate_up must have been
        launched on these routes with the same cfg first (else it waits for ever)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        gate_up_n, gate_up_m = self._gate_up_grid(act.shape[0], cfg)[0], cfg.block_m
        w2, cfg = self.w2, cfg.for_down()
        rows_dtype = torch.bfloat16 if cfg.bf16_pair_rows else torch.float32
        part = torch.empty(cfg.split_k, act.shape[0], h, dtype=rows_dtype, device=act.device)  # [S, P, H]
        num_n, num_m = _cdiv(w2.padded_rows, cfg.block_n_down), self._row_blocks(act.shape[0], cfg)
        self.kernels.down_kernel[(num_n * (e if cfg.expert_grid else num_m) * cfg.split_k,)](
            act, act.stride(0),
            routes.pairs, routes.router, routes.bounds, routes.bounds.stride(0),
            w2.w, w2.w.stride(0), w2.w.stride(1),
            w2.s, w2.s.stride(0), w2.s.stride(1),
            part, part.stride(0), part.stride(1), routes.ready, gate_up_n,
            num_n, num_m, e, h, w2.padded_rows, i,
            GROUP=w2.group_size, BLOCK_K=w2.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down,
            TILE_N=w2.block_n, GROUP_M=cfg.group_m, BLOCK_E=_expert_slots(e),
            IS_BF16=act.dtype == torch.bfloat16, USE_PTX=_use_ptx(cfg, act), SWAP_AB=cfg.swap_ab,
            SCALE_W=cfg.scale_weights, EVEN_K=i % w2.block_k == 0, EVEN_N=w2.padded_rows % cfg.block_n_down == 0,
            NUM_STAGES=cfg.num_stages, EXPERT_GRID=cfg.expert_grid, SPLIT_K=cfg.split_k, GATE_UP_M=gate_up_m,
            WAIT_EXPERT=cfg.wait_per_expert,
            **_launch_options(cfg, act, cfg.num_warps),
        )
        return part

    def combine(self, part, routes: Routes, cfg: TritonConfig) -> torch.Tensor:
        """-> out [T, H] fp32: row t the sum of its pairs' rows of `part` [S, P, H], in (split, pair) order (zeros
        for a row without pairs)."""
        h = self.hidden_size
        out = torch.empty(routes.row_bounds.shape[0] - 1, h, dtype=torch.float32, device=part.device)
        self.kernels.combine_kernel[(out.shape[0], _cdiv(h, COMBINE_BLOCK_N))](
            part, part.stride(0), part.stride(1), routes.pairs if routes.cpairs is None else routes.cpairs,
            routes.row_bounds, routes.row_bounds.stride(0), out, out.stride(0), h,
            BLOCK_R=COMBINE_BLOCK_R, BLOCK_N=COMBINE_BLOCK_N, SPLITS=part.shape[0], PAIR_ORDER=routes.cpairs is None,
            **_launch_options(cfg, part, num_warps=COMBINE_WARPS),
        )
        return out


def _tiles(num_n: int, tiles: int) -> int:
    """Column blocks per program: `tiles` where it divides the column blocks, else 1."""
    return tiles if num_n % tiles == 0 else 1


def _use_ptx(cfg: TritonConfig, x: torch.Tensor) -> bool:
    return cfg.ptx_dequant and x.is_cuda and not is_rocm(x.device)


def compile_refusal(device: torch.device) -> str | None:
    """None when the installed Triton compiles for its current target (the GPU `device` is on), else why not:
    a one-store kernel warmed up there (compiled, not launched; the compiler's own messages go to stderr)."""
    import triton

    from kernels import triton_w4a16

    try:
        triton_w4a16.target_probe_kernel.warmup(torch.empty(1, dtype=torch.int32, device=device), grid=(1,))
    except Exception as err:  # noqa: BLE001 -- what each backend raises is its own (PassManager, LLVM, ...)
        arch = triton.runtime.driver.active.get_current_target().arch
        return f"Triton {triton.__version__} does not compile for {arch} ({type(err).__name__}: {err})"
    return None


def has_dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may signal and wait for dependent launches (CUDA, sm_90+)."""
    return device.type == "cuda" and not is_rocm(device) and _capability(device.index)[0] >= 9


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _launch_options(cfg: TritonConfig, x: torch.Tensor, num_warps: int) -> dict:
    """USE_GDC and the launch options of the GEMMs and the combine: warps, and a programmatic dependent
    launch where the GPU has one."""
    gdc = cfg.dependent_launch and has_dependent_launch(x.device)
    return {"USE_GDC": gdc, "num_warps": num_warps, **({"launch_pdl": True} if gdc else {})}


def _expert_slots(num_experts: int) -> int:
    """BLOCK_E of the GEMM kernels: at least 128 (masked loads of the bounds), so layers with up to
    128 experts share one compiled kernel per configuration."""
    return _next_pow2(max(num_experts, 128))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
