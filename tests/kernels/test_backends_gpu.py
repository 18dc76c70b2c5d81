"""GPU backends against the reference: Triton and the CUDA build of hip_fdot2 (marked `gpu`).

Without a GPU these tests are skipped by the `cuda` fixture, never passed.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.backends.hip_fdot2 import HipFdot2Backend
from kernels.backends.triton_moe import TritonBackend, TritonConfig, TritonExperts, compile_refusal
from kernels.oracle import choose_backend
from kernels.quant import W4A16ExpertWeights
from kernels.reference import moe_experts_w4a16_reference
from tests.kernels.conftest import make_problem, random_int4

pytestmark = pytest.mark.gpu

# (hidden, intermediate, group): N and K not multiples of the tiles, three group sizes
SHAPES = [(160, 96, 32), (192, 320, 64), (384, 256, 128)]
TOKENS = [1, 3, 17]
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _reference(p, x, activation="silu"):
    return moe_experts_w4a16_reference(
        x, p.pair_rows, p.pair_experts, p.pair_weights, p.weights.to(x.device), activation
    )


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "triton-dequant"])
def test_triton_matches_reference(cuda, moe_problem, rel_error, hidden, inter, group, tokens, dtype, ptx):
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=tokens).to(cuda)
    x = p.hidden.to(dtype)
    experts = TritonExperts(p.weights, "silu", cuda, TritonConfig(ptx_dequant=ptx))
    out = experts(x, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "config",
    [
        # stored tiles wider than N: partial tiles everywhere
        TritonConfig(block_n_gate_up=128, block_n_down=256, tile_n_gate_up=128, tile_n_down=256),
        TritonConfig(block_m=64, block_n_gate_up=64, block_n_down=128, num_warps=8),
        TritonConfig(block_m=32, num_stages=4),
        TritonConfig(block_k=64, block_n_gate_up=32, tile_n_gate_up=32, block_n_down=64, tile_n_down=64,
                     num_stages=5, num_warps_down=8),
        TritonConfig(block_k=64, block_n_gate_up=32, tile_n_gate_up=32, block_m=32, num_stages=4, num_stages_down=2),
        # prefill shapes: blocks of 2-4 stored tiles (the last partial), weights as the left operand,
        # scales on the weights
        TritonConfig(block_m=64, block_n_gate_up=128, block_n_down=256, num_warps=8, swap_ab=True),
        TritonConfig(block_m=128, block_n_gate_up=256, block_n_down=128, num_warps=8, swap_ab=True, group_m=2,
                     scale_weights=True),
        TritonConfig(block_m=64, block_n_gate_up=128, block_n_down=128, num_warps=8, num_stages=4, group_m=1,
                     scale_weights=True),
        TritonConfig(block_k=64, block_m=64, block_n_gate_up=128, num_warps=8, swap_ab=True, scale_weights=True),
        TritonConfig(swap_ab=True),
        # for_load's up to 8 pairs per expert: 8-row blocks, x as the MMA's 8-wide operand; for few experts down
        # on 16-row blocks unswapped, its k-blocks split
        TritonConfig(block_m=8, swap_ab=True, num_warps=2),
        TritonConfig(block_m=8, swap_ab=True, num_warps=2, group_m=1, block_m_down=16, swap_ab_down=False,
                     num_warps_down=4, num_stages_down=4, split_k=2),
        # main's decode grid: a program walks its expert's three 16-row blocks, or two 32-row blocks with the
        # prefill operands
        TritonConfig(expert_grid=True),
        TritonConfig(block_m=32, block_n_gate_up=128, num_warps=8, swap_ab=True, scale_weights=True, expert_grid=True),
        # down's k-blocks split (I 192: two k-blocks), over row blocks and on main's grid (a third split empty)
        TritonConfig(num_warps=2, num_warps_down=4, num_stages_down=4, split_k=2),
        TritonConfig(num_warps=2, num_stages_down=4, split_k=3, expert_grid=True),
        # gate_up programs owning three column blocks (I 192: all of them), prefill and decode operands
        TritonConfig(block_m=64, swap_ab=True, scale_weights=True, tiles_gate_up=3),
        TritonConfig(num_warps=2, tiles_gate_up=3),
        # down's pair rows in fp32 (bf16 by default), with and without split k-blocks
        TritonConfig(block_m=64, swap_ab=True, scale_weights=True, tiles_gate_up=2, bf16_pair_rows=False),
        TritonConfig(block_m=8, swap_ab=True, num_warps=2, split_k=2, bf16_pair_rows=False),
        TritonConfig(num_warps=2, bf16_pair_rows=False),
        # down waiting for all of gate_up (the dependent launch's own wait), not per expert
        TritonConfig(wait_per_expert=False),
        TritonConfig(block_m=8, swap_ab=True, num_warps=2, split_k=2, wait_per_expert=False),
    ],
)
def test_triton_configs_and_gelu(cuda, moe_problem, rel_error, config):
    p = moe_problem(experts=6, hidden=192, inter=192, group=64, tokens_per_expert=33).to(cuda)
    x = p.hidden.to(torch.float16)
    for activation in ("silu", "gelu"):
        out = TritonExperts(p.weights, activation, cuda, config)(x, p.pair_rows, p.pair_experts, p.pair_weights)
        assert rel_error(out, _reference(p, x, activation)) < 1e-2


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
@pytest.mark.parametrize("tokens", [1, 17])  # one row block per expert, two
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_expert_grid_matches_reference(cuda, moe_problem, rel_error, hidden, inter, group, tokens, dtype):
    """Main's decode grid (for_load's for many experts up to 8 pairs each until 2026-12-04, a sweep neighbour
    since): a program per (expert, column block) walks the expert's row blocks."""
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=tokens).to(cuda)
    x = p.hidden.to(dtype)
    out = TritonExperts(p.weights, "silu", cuda, TritonConfig(expert_grid=True))(
        x, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
# for_load's prefill tiles: 64-row and 128-row blocks, each for few large and for many small experts
@pytest.mark.parametrize("tokens,layer_experts", [(48, 8), (48, 128), (200, 8), (200, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "triton-dequant"])
def test_triton_prefill_matches_reference(cuda, moe_problem, rel_error, hidden, inter, group, tokens, layer_experts,
                                          dtype, ptx):
    """The default (for_load) prefill configurations, with PTX dequantization on or off."""
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=tokens).to(cuda)
    x = p.hidden.to(dtype)
    cfg = TritonConfig.for_load(tokens * layer_experts, layer_experts)  # as for a layer of that many experts
    assert cfg.block_m >= 64, cfg  # the prefill tiles are what this test checks
    cfg = replace(cfg, ptx_dequant=ptx)
    out = TritonExperts(p.weights, "silu", cuda, cfg)(x, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
# for_gfx11's branches: 16-row blocks (many experts; few, down's k-blocks split), 32-row blocks
@pytest.mark.parametrize("tokens,layer_experts", [(1, 128), (16, 8), (17, 128), (64, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_amd_configurations_match_reference(cuda, moe_problem, rel_error, hidden, inter, group, tokens,
                                                   layer_experts, dtype):
    """What an AMD GPU launches (for_gfx11, whose code objects tests/kernels/test_triton_isa.py checks), here with
    Triton's own dequantization as there: the same kernels and arithmetic, CUDA's code generation."""
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=tokens).to(cuda)
    x = p.hidden.to(dtype)
    cfg = replace(TritonConfig.for_load(tokens * layer_experts, layer_experts, amd=True), ptx_dequant=False)
    out = TritonExperts(p.weights, "silu", cuda, cfg)(x, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("hidden,inter,group", SHAPES + [(2304, 256, 128)])  # last: K split over 2 blocks
@pytest.mark.parametrize("tokens", [1, 3, 5, 8, 17])  # staged 1, 2, 4, 8 rows at a time
def test_hip_fdot2_cuda_build_matches_reference(cuda, moe_problem, rel_error, hidden, inter, group, tokens):
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=tokens).to(cuda)
    backend = HipFdot2Backend()
    assert backend.supports_device(cuda).ok, backend.supports_device(cuda).reason
    experts = backend.prepare(p.weights, "silu", cuda)
    x = p.hidden.to(torch.float16)
    out = experts(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, x)) < 1e-2


def test_hip_fdot2_gelu(cuda, moe_problem, rel_error):
    p = moe_problem(experts=2, hidden=256, inter=128, group=32, tokens_per_expert=4).to(cuda)
    out = HipFdot2Backend().prepare(p.weights, "gelu", cuda)(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, p.hidden.to(torch.float16), "gelu")) < 1e-2


def test_compile_probe_passes_on_this_gpu(cuda):
    """The probe TritonBackend runs on ROCm GPUs (compile a one-store kernel for the current target), through a
    real driver: this GPU's target compiles."""
    assert compile_refusal(cuda) is None


def test_oracle_on_gpu(cuda, moe_problem):
    p = moe_problem(experts=2, hidden=128, inter=64, group=32, tokens_per_expert=1)
    choice = choose_backend(cuda, p.weights.scheme, "silu")
    expected = "hip_fdot2" if torch.version.hip and "gfx103" in torch.cuda.get_device_properties(cuda).gcnArchName else "triton"
    assert choice.backend.name == expected
    assert isinstance(choose_backend(cuda, p.weights.scheme, "silu", forced="hip_fdot2").backend, HipFdot2Backend)
    assert isinstance(choose_backend(cuda, p.weights.scheme, "silu", forced="triton").backend, TritonBackend)


@pytest.mark.parametrize("hidden,inter,group", [(160, 96, 32), (192, 320, 64), (256, 128, 128), (512, 256, 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "triton-dequant"])
def test_triton_block_k_64(cuda, moe_problem, rel_error, hidden, inter, group, dtype, ptx):
    """The 64-wide weight blocks: two groups per block (group 32), one, or half a group (256)."""
    p = moe_problem(experts=4, hidden=hidden, inter=inter, group=group, tokens_per_expert=5).to(cuda)
    x = p.hidden.to(dtype)
    config = TritonConfig(block_k=64, ptx_dequant=ptx)
    out = TritonExperts(p.weights, "silu", cuda, config)(x, p.pair_rows, p.pair_experts, p.pair_weights)
    assert rel_error(out, _reference(p, x)) < TOLERANCE[dtype]


@pytest.mark.parametrize("tokens", [1, 2, 8, 64, 256])  # decode, then for_load's two prefill tiles
def test_triton_model_shape(cuda, rel_error, tokens):
    """Qwen3-30B-A3B expert shapes (H 2048, I 768, group 128), 16 experts, shuffled pairs, bf16."""
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 2048, 768, 4
    weights = W4A16ExpertWeights(random_int4(experts, 2 * inter, hidden, 128, gen), random_int4(experts, hidden, inter, 128, gen))
    rows = experts * tokens // top_k
    pair_experts = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)]).flatten()
    pair_rows = torch.arange(rows).repeat_interleave(top_k)
    pair_weights = torch.rand(rows * top_k, generator=gen)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    args = [t.to(cuda) for t in (x, pair_rows, pair_experts, pair_weights)]
    out = TritonExperts(weights, "silu", cuda)(*args)
    ref = moe_experts_w4a16_reference(*args, weights.to(cuda))
    assert rel_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "experts,pairs", [(128, 1), (128, 256), (128, 1024), (128, 3000), (6, 37), (3, 5000), (128, 9000), (256, 70000)]
)
# up to (experts + rows) * pairs = 2^22 one ranking launch (1 or more keys per program, one or two steps over the
# pairs at 1000 rows); counting: one, two (1000, 1 << 14), three passes by row. Ascending rows: the experts ranked
# up to 8192 pairs, else counted
@pytest.mark.parametrize("num_rows", [1, 1000, 1 << 14, 1 << 20])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows_ascending", [False, True])
def test_triton_route(cuda, experts, pairs, num_rows, index_dtype, rows_ascending):
    """Pairs grouped by expert and by row, both stable (one ranking launch up to
    ROUTE_SCAN_MAX_WORK, counting sorts above): exactly torch's stable sorts, so the positions
    depend only on the inputs. Rows given in ascending order: by expert the same, by row the pairs' own order."""
    gen = torch.Generator().manual_seed(pairs)
    pair_experts = torch.randint(0, experts, (pairs,), generator=gen)
    if experts == 6:
        pair_experts = pair_experts % 2 * 3  # empty experts between full ones
    pair_rows = torch.randint(0, num_rows, (pairs,), generator=gen)
    if rows_ascending:
        pair_rows = pair_rows.sort().values
    pair_weights = torch.rand(pairs, generator=gen)
    prepared = TritonExperts(make_problem(experts, 64, 32, 32, 1).weights, "silu", cuda)  # smallest layer
    routes = prepared.route(
        pair_rows.to(cuda, index_dtype), pair_experts.to(cuda, index_dtype), pair_weights.to(cuda), num_rows,
        rows_ascending,
    )
    expected = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(pair_experts, minlength=experts).cumsum(0)])
    assert torch.equal(routes.bounds.cpu().long(), expected)
    by_expert = torch.sort(pair_experts, stable=True).indices
    assert torch.equal(routes.pairs.cpu().long(), by_expert)
    assert torch.equal(routes.rows.cpu().long(), pair_rows[by_expert])
    assert torch.equal(routes.router.cpu(), pair_weights[by_expert])
    by_row = torch.sort(pair_rows, stable=True)
    assert torch.equal(routes.crows.cpu().long(), by_row.values)
    if rows_ascending:
        assert routes.cpairs is None  # position j is pair j
    else:
        assert torch.equal(routes.cpairs.cpu().long(), by_row.indices)
    row_counts = torch.bincount(pair_rows, minlength=num_rows)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), row_counts.cumsum(0)])  # row t: [starts[t], starts[t+1])
    assert torch.equal(routes.row_bounds.cpu().long(), starts)
