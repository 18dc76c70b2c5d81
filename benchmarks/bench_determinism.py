"""The cost of deterministic partials (issue 11): the Triton layer with its fixed-order combine
against the same layer with the float-atomic down projection it replaced, in one run.

    python -m benchmarks.bench_determinism --out results/bench_determinism.json

Qwen3-30B-A3B shapes, every expert M tokens (bench_kernel's problems), M = 1, 2, 4, 8, 16 (decode)
and 64 (prefill). Both variants share route and gate_up; only the reduction differs: `atomic`
adds router * (act @ w2^T) into out with tl.atomic_add (the kernel before issue 11, kept here
only to be measured), `deterministic` is TritonExperts (down to [P, H], then combine_kernel).
Also times the CUDA build of hip_fdot2 (deterministic only) and whether each variant repeats
bitwise over 20 calls.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.bench_kernel import MODELS, problem, random_weights, time_call, time_graph
from kernels import triton_w4a16
from kernels.backends.triton_moe import TritonExperts, _expert_slots, _use_ptx
from kernels.oracle import create_backend


@triton.jit
def atomic_down_kernel(
    act_ptr, stride_at, srows_ptr, sweights_ptr, bounds_ptr, stride_b, w_ptr, stride_we, stride_wt, s_ptr,
    stride_se, stride_sg, out_ptr, stride_ot, num_n, num_m, E, H, Hp, I,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, IS_BF16: tl.constexpr,
    USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr, SCALE_W: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """The pre-issue-11 down_kernel: out[row] += router * (act @ w2^T) with float atomics."""
    e, m0, end, nb = triton_w4a16._work_item(tl.program_id(0), num_n, num_m, bounds_ptr, stride_b, E,
                                             BLOCK_M, BLOCK_E, GROUP_M)
    if e < E:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        in_tile, offs_n = triton_w4a16._tile_offsets(nb, stride_wt, BLOCK_N, TILE_N, BLOCK_K // 4, SWAP_AB)
        acc = triton_w4a16.down_rows(
            act_ptr, stride_at, offs_m, m_mask, w_ptr + e.to(tl.int64) * stride_we + in_tile,
            s_ptr + e.to(tl.int64) * stride_se + offs_n, offs_n < Hp, stride_sg, I, 0, tl.cdiv(I, BLOCK_K),
            GROUP, BLOCK_K, BLOCK_M, BLOCK_N, TILE_N, IS_BF16, USE_PTX, SWAP_AB, SCALE_W, EVEN_K, EVEN_N, NUM_STAGES)
        rows = tl.load(srows_ptr + offs_m, mask=m_mask, other=0)
        router = tl.load(sweights_ptr + offs_m, mask=m_mask, other=0.0)
        out = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
        tl.atomic_add(out, acc * router[:, None], mask=m_mask[:, None] & (offs_n[None, :] < H), sem="relaxed")


class AtomicTritonExperts(TritonExperts):
    """TritonExperts with the atomic down projection instead of down + combine."""

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        x = hidden.contiguous()
        cfg = self.config_for(pair_rows.numel())
        routes = self.route(pair_rows, pair_experts, pair_weights, x.shape[0])
        act = self.gate_up(x, routes, cfg)
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)  # the atomics add into it
        w2, e = self.w2, self.num_experts
        num_n, num_m = -(-w2.padded_rows // cfg.block_n_down), self._row_blocks(act.shape[0], cfg)
        atomic_down_kernel[(num_n * num_m,)](
            act, act.stride(0), routes.rows, routes.router, routes.bounds, routes.bounds.stride(0),
            w2.w, w2.w.stride(0), w2.w.stride(1), w2.s, w2.s.stride(0), w2.s.stride(1),
            out, out.stride(0), num_n, num_m, e, self.hidden_size, w2.padded_rows, self.intermediate_size,
            GROUP=w2.group_size, BLOCK_K=w2.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down,
            TILE_N=w2.block_n, GROUP_M=cfg.group_m, BLOCK_E=_expert_slots(e),
            IS_BF16=act.dtype == torch.bfloat16, USE_PTX=_use_ptx(cfg, act), SWAP_AB=cfg.swap_ab,
            SCALE_W=cfg.scale_weights, EVEN_K=self.intermediate_size % w2.block_k == 0, EVEN_N=w2.padded_rows % cfg.block_n_down == 0,
            NUM_STAGES=cfg.num_stages_down or cfg.num_stages, num_warps=cfg.num_warps_down or cfg.num_warps,
        )
        return out


def repeats(fn, calls: int = 20) -> bool:
    first = fn()
    return all(torch.equal(fn(), first) for _ in range(calls - 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_determinism.json"))
    parser.add_argument("--tokens", default="1,2,4,8,16,64", help="tokens per expert, comma-separated")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    shape = MODELS["qwen3-30b-a3b"]
    weights = random_weights(shape, device)
    variants = {
        "triton_atomic": AtomicTritonExperts(weights, "silu", device),
        "triton_deterministic": TritonExperts(weights, "silu", device),
        "hip_fdot2_deterministic": create_backend("hip_fdot2").prepare(weights, "silu", device),
    }
    results = []
    for m in (int(t) for t in args.tokens.split(",")):
        p = problem(shape, m, device)
        call_args = (p.hidden, p.pair_rows, p.pair_experts, p.pair_weights)
        row = {"tokens_per_expert": m, "rows": p.hidden.shape[0], "pairs": p.pair_rows.numel()}
        for name, experts in variants.items():
            fn = lambda experts=experts: experts(*call_args)  # noqa: E731
            graph = time_graph(fn, device, args.iters)
            row[name] = {
                "time_us": round(time_call(fn, device, args.iters) * 1e6, 2),
                "graph_time_us": None if graph is None else round(graph * 1e6, 2),
                "bitwise_repeatable_20_calls": repeats(fn),
            }
        atomic, det = row["triton_atomic"]["graph_time_us"], row["triton_deterministic"]["graph_time_us"]
        row["triton_deterministic_over_atomic"] = round(det / atomic, 4)
        print(json.dumps(row), flush=True)
        results.append(row)
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "shape": shape.name, "iters": args.iters}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
