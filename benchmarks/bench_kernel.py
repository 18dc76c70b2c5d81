"""W4A16 expert kernels on real MoE shapes: time, weight bandwidth, TFLOP/s, and the ceilings.

    python -m benchmarks.bench_kernel --out results/bench_kernel.json [--device cuda] [--sweep]

Every expert gets exactly M tokens (GPU: M = 1, 2, 4, 8, 16, 64, 128, 256, 1024), so every weight
is read once per call. Effective bandwidth = int4 payload + 16-bit group scales (the W4A16
checkpoint size) / time; TFLOP/s = 2 * pairs * 3 * H * I / time. Ceilings measured in the same run:
a device copy (read + write bytes / time), a dense bf16 torch.matmul at a large square shape
(FLOP / time), and torch's own int4 GEMM (`_weight_int4pack_mm`, tinygemm on CUDA;
`_weight_int4pack_mm_for_cpu` on CPU) on the same weights, once as a single GEMM over all experts
(its best case) and once looped over experts, up to M = 64 (a decode ceiling), and the layer with its weights
dequantized to bf16 through torch.bmm (cuBLAS on a GPU: dense bf16 on the same GEMM shapes). The peer on a GPU:
vLLM 0.32.0's Triton int4 MoE kernel with vLLM's default launch parameters (benchmarks/vllm_peer/),
checked against the reference on a small shape first (meta) and at M = 1 and 8 (rows).
On CPU the shapes keep H and I but fewer experts, and fewer token counts and iterations.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kernels.backends.base import PreparedExperts
from kernels.oracle import create_backend, refusal
from kernels.quant import Int4Weights, W4A16ExpertWeights
from kernels.reference import moe_experts_w4a16_reference


@dataclass(frozen=True, slots=True)
class MoeShape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int


MODELS = {
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", hidden=2048, inter=768, experts=128, top_k=8),
    "mixtral-8x7b": MoeShape("mixtral-8x7b", hidden=4096, inter=14336, experts=8, top_k=2),
}
CPU_EXPERTS = {"qwen3-30b-a3b": 8, "mixtral-8x7b": 2}
GROUP = 128


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    experts: int
    backend: str
    tokens_per_expert: int
    time_us: float
    weight_bytes: int
    bandwidth_gbps: float
    fraction_of_copy: float
    tflops: float
    fraction_of_matmul: float
    graph_time_us: float | None = None
    rel_error_vs_reference: float | None = None
    config: str = ""


@dataclass(frozen=True, slots=True)
class Problem:
    shape: MoeShape
    tokens_per_expert: int
    hidden: torch.Tensor  # [T, H] bf16
    pair_rows: torch.Tensor  # [P]
    pair_experts: torch.Tensor  # [P]
    pair_weights: torch.Tensor  # [P]


def random_weights(shape: MoeShape, device: torch.device, seed: int = 0) -> W4A16ExpertWeights:
    """Random nibbles and signed scales; the values do not change the timing."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def projection(n: int, k: int) -> Int4Weights:
        packed = torch.randint(-(2**31), 2**31 - 1, (shape.experts, n, k // 8), generator=gen, device=device, dtype=torch.int32)
        scales = torch.randn(shape.experts, n, k // GROUP, generator=gen, device=device) * 0.02
        return Int4Weights(packed, scales, GROUP)

    return W4A16ExpertWeights(projection(2 * shape.inter, shape.hidden), projection(shape.hidden, shape.inter))


def problem(shape: MoeShape, tokens_per_expert: int, device: torch.device) -> Problem:
    """T = E * M / k rows; row t routes to experts (t*k + j) % E: each expert gets exactly M pairs."""
    rows = shape.experts * tokens_per_expert // shape.top_k
    assert rows * shape.top_k == shape.experts * tokens_per_expert, "E * M must be a multiple of top-k"
    flat = torch.arange(rows * shape.top_k, device=device)  # [P]
    gen = torch.Generator(device=device).manual_seed(tokens_per_expert)
    return Problem(
        shape,
        tokens_per_expert,
        torch.randn(rows, shape.hidden, generator=gen, device=device).to(torch.bfloat16),
        flat // shape.top_k,
        flat % shape.experts,
        torch.rand(rows * shape.top_k, generator=gen, device=device),
    )


def layer_flop(shape: MoeShape, tokens_per_expert: int) -> int:
    """Multiply-adds x 2 of gate_up and down over every pair (the routed experts' useful work)."""
    return 2 * shape.experts * tokens_per_expert * 3 * shape.hidden * shape.inter


def checkpoint_bytes(shape: MoeShape) -> int:
    """int4 payload plus one 16-bit scale per group, for all experts of one layer."""
    params = shape.experts * 3 * shape.hidden * shape.inter
    return params // 2 + 2 * params // GROUP


# ---- timing --------------------------------------------------------------------------------------


def time_call(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds per call, calls issued back to back (the GPU queue stays full)."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) / iters


def time_graph(fn: Callable[[], object], device: torch.device, iters: int) -> float | None:
    """Mean seconds per CUDA-graph replay of `fn` (no launch overhead), None if it cannot be captured."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:  # e.g. an op that synchronises with the host
        print(f"  (no CUDA graph: {str(err).splitlines()[0]})")
        return None
    return time_call(graph.replay, device, iters)


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """Bytes read + written per second by a device-to-device copy of a buffer far larger than caches."""
    size = (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, iters)
    return 2 * size / seconds


def matmul_flops(device: torch.device, iters: int) -> float:
    """FLOP per second of a dense bf16 torch.matmul at a large square shape (fp32 on CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / time_call(lambda: a @ b, device, iters)


# ---- what is measured ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Peaks:
    """The device's ceilings, measured in the same run."""

    copy_bandwidth: float  # bytes / s, read + write
    matmul_flops: float  # FLOP / s, dense bf16


def run_backend(
    name: str, weights: W4A16ExpertWeights, problems: list[Problem], device: torch.device, iters: int,
    peaks: Peaks, experts: PreparedExperts | None = None, config: str = "",
) -> list[Row]:
    """One prepared backend (or the vLLM peer) over every token count."""
    shape = problems[0].shape
    if experts is None:
        backend = create_backend(name)
        reason = refusal(backend, device, weights.scheme, "silu")
        if reason is not None:
            print(f"  {name}: skipped ({reason})")
            return []
        experts = backend.prepare(weights, "silu", device)
    rows = []
    for p in problems:
        def call(p: Problem = p) -> torch.Tensor:  # pairs in token order, as a worker gets them
            return experts(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights, rows_ascending=True)

        seconds = time_call(call, device, iters)
        error = _reference_error(call(), p, weights) if p.tokens_per_expert in CHECKED_TOKENS else None
        graph = time_graph(call, device, iters)
        chosen = config or _load_config(experts, p)
        rows.append(_show(_row(shape, name, p.tokens_per_expert, seconds, peaks, graph, error, chosen)))
    return rows


CHECKED_TOKENS = (1, 8)  # the Ms at which a row's output is compared with the reference


def _reference_error(out: torch.Tensor, p: Problem, weights: W4A16ExpertWeights) -> float:
    """Max |out - reference| over max |reference|, for the layer's output [T, H] on problem p."""
    ref = moe_experts_w4a16_reference(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights, weights)
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _load_config(experts, p: Problem) -> str:
    """The launch parameters TritonExperts picks for this load (for_load), else ''."""
    from kernels.backends.triton_moe import TritonExperts

    if not isinstance(experts, TritonExperts) or experts.config is not None:
        return ""
    return _describe(experts.config_for(p.pair_rows.numel()), changed_only=True)


TORCH_INT4_MAX_TOKENS = 64  # a decode ceiling: above it the loop over experts only costs run time


def torch_int4_rows(weights: W4A16ExpertWeights, problems: list[Problem], device: torch.device, iters: int,
                    peaks: Peaks) -> list[Row]:
    """torch's int4 GEMM: one GEMM over all experts' weights (best case), and looped per expert."""
    shape = problems[0].shape
    problems = [p for p in problems if p.tokens_per_expert <= TORCH_INT4_MAX_TOKENS]
    dense13, dense2 = _TorchInt4(weights.w13, device), _TorchInt4(weights.w2, device)
    per_expert13 = [_TorchInt4(_expert(weights.w13, e), device) for e in range(shape.experts)]
    per_expert2 = [_TorchInt4(_expert(weights.w2, e), device) for e in range(shape.experts)]
    rows = []
    for p in problems:
        x13 = torch.randn(p.tokens_per_expert, shape.hidden, device=device).to(torch.bfloat16)
        x2 = torch.randn(p.tokens_per_expert, shape.inter, device=device).to(torch.bfloat16)

        def one_gemm() -> None:
            dense13(x13)
            dense2(x2)

        def per_expert() -> torch.Tensor:
            out = torch.zeros(p.hidden.shape[0], shape.hidden, device=device)
            order = torch.argsort(p.pair_experts)
            per = p.tokens_per_expert  # every expert has exactly M pairs
            for e in range(shape.experts):
                pairs = order[e * per : (e + 1) * per]
                gate, up = per_expert13[e](p.hidden[p.pair_rows[pairs]]).float().chunk(2, dim=-1)
                y = per_expert2[e]((torch.nn.functional.silu(gate) * up).to(torch.bfloat16)).float()
                out.index_add_(0, p.pair_rows[pairs], y * p.pair_weights[pairs, None])
            return out

        for name, fn in (("torch_int4_one_gemm", one_gemm), ("torch_int4_per_expert", per_expert)):
            seconds = time_call(fn, device, iters)
            rows.append(_show(_row(shape, name, p.tokens_per_expert, seconds, peaks, time_graph(fn, device, iters))))
    return rows


def torch_bf16_rows(weights: W4A16ExpertWeights, problems: list[Problem], device: torch.device, iters: int,
                    peaks: Peaks) -> list[Row]:
    """The same layer with the weights dequantized to bf16, through torch.bmm (cuBLAS on a GPU): every expert's
    M rows are one batch entry (the bench gives each expert exactly M), so this is dense bf16's best case on these
    very GEMM shapes: the rows gathered by expert, gate_up, SiLU * up, down and the router weights, but no routing
    and no sum of each token's pairs. It reads four times the int4 bytes, and it does not dequantize in the loop."""
    shape = problems[0].shape
    w13, w2 = (torch.stack([w.dequantize(e).to(torch.bfloat16) for e in range(shape.experts)]).transpose(1, 2)
               for w in (weights.w13, weights.w2))  # [E, K, N] each
    rows = []
    for p in problems:
        by_expert = torch.argsort(p.pair_experts, stable=True).view(shape.experts, p.tokens_per_expert)  # [E, M]
        pair_rows, pair_weights = p.pair_rows[by_expert], p.pair_weights[by_expert, None].to(torch.bfloat16)

        def layer(p: Problem = p, pair_rows=pair_rows, pair_weights=pair_weights) -> torch.Tensor:
            gate, up = torch.bmm(p.hidden[pair_rows], w13).chunk(2, dim=-1)  # [E, M, I] each
            return torch.bmm(torch.nn.functional.silu(gate) * up, w2) * pair_weights  # [E, M, H]

        seconds = time_call(layer, device, iters)
        error = None
        if p.tokens_per_expert in CHECKED_TOKENS:  # its pairs summed per token, not timed
            out = torch.zeros(p.hidden.shape, device=device).index_add_(0, pair_rows.flatten(),
                                                                        layer().flatten(0, 1).float())
            error = _reference_error(out, p, weights)
        rows.append(_show(_row(shape, "torch_bf16_bmm", p.tokens_per_expert, seconds, peaks,
                               time_graph(layer, device, iters), error)))
    return rows


class _TorchInt4:
    """All experts of one projection as one [E*N, K] int4 matrix in torch's packed layout."""

    def __init__(self, weights: Int4Weights, device: torch.device) -> None:
        e, n = weights.num_experts, weights.out_features
        q = torch.cat([weights.unpacked(i) for i in range(e)])  # [E*N, K] uint8
        scales = weights.scales.reshape(e * n, -1).t()  # [K/G, E*N]
        self.scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], -1).to(torch.bfloat16).contiguous()
        self.group = weights.group_size
        self.cuda = device.type == "cuda"
        if self.cuda:  # tinygemm takes uint8 [N, K/2] (high nibble first)
            self.packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)


def _expert(weights: Int4Weights, e: int) -> Int4Weights:
    return Int4Weights(weights.packed[e : e + 1], weights.scales[e : e + 1], weights.group_size)


def _row(shape, backend, m, seconds, peaks: Peaks, graph=None, error=None, config="") -> Row:
    best = min(seconds, graph) if graph is not None else seconds
    bandwidth, flops = checkpoint_bytes(shape) / best, layer_flop(shape, m) / best
    return Row(
        shape.name, shape.experts, backend, m, round(seconds * 1e6, 2), checkpoint_bytes(shape),
        round(bandwidth / 1e9, 2), round(bandwidth / peaks.copy_bandwidth, 4),
        round(flops / 1e12, 2), round(flops / peaks.matmul_flops, 4),
        None if graph is None else round(graph * 1e6, 2), error, config,
    )


HEADER = (
    f"{'model':15} {'backend':22} {'M':>4} {'time us':>9} {'graph us':>9} {'GB/s':>7} {'of copy':>7} "
    f"{'TFLOP/s':>7} {'of mm':>6} {'rel err':>8}  config"
)


def _show(r: Row) -> Row:
    graph = f"{r.graph_time_us:9.1f}" if r.graph_time_us is not None else f"{'-':>9}"
    err = f"{r.rel_error_vs_reference:8.1e}" if r.rel_error_vs_reference is not None else f"{'-':>8}"
    print(f"{r.model:15} {r.backend:22} {r.tokens_per_expert:4d} {r.time_us:9.1f} {graph} "
          f"{r.bandwidth_gbps:7.1f} {r.fraction_of_copy:7.1%} {r.tflops:7.1f} {r.fraction_of_matmul:6.1%} "
          f"{err}  {r.config}", flush=True)
    return r


DECODE_MAX_TOKENS = 16  # the sweep times decode neighbours up to here, prefill ones above


def decode_neighbours(cfg) -> list:
    """cfg and one step from it in each decode direction: swap_ab (unswapped on blocks of at least 16 rows), 3 <-> 4
    stages, down tiles of 128 <-> 256 rows, main's expert grid <-> row blocks, gate_up's 2 <-> 4 warps, gate_up
    blocks twice as wide (each program reads its rows of x once for twice the columns), down's k-blocks split in 2
    <-> not split."""
    down = replace(cfg, block_n_down=256, num_warps_down=8) if cfg.block_n_down != 256 else \
        replace(cfg, block_n_down=128, num_warps_down=None)
    warps = replace(cfg, num_warps=6 - cfg.num_warps, num_warps_down=cfg.num_warps_down or cfg.num_warps) \
        if cfg.num_warps in (2, 4) else cfg
    swap = replace(cfg, swap_ab=not cfg.swap_ab, block_m=max(16, cfg.block_m) if cfg.swap_ab else cfg.block_m)
    return list(dict.fromkeys([cfg, swap, replace(cfg, num_stages=7 - cfg.num_stages),
                               down, replace(cfg, expert_grid=not cfg.expert_grid), warps,
                               replace(cfg, block_n_gate_up=2 * cfg.block_n_gate_up),
                               replace(cfg, split_k=1 if cfg.split_k > 1 else 2)]))


def prefill_neighbours(cfg) -> list:
    """cfg and one step from it in each prefill direction: down tiles of 128 <-> 256 rows (on the launch's warps),
    4 stages, 4 <-> 8 warps in down, no grouping of row blocks (group_m 1), 1 <-> 2 column blocks per gate_up
    program (tiles_gate_up); below 128-row blocks also 4 <-> 8 warps in both and gate_up tiles twice as wide with
    8 warps (at 128 rows, two 128 x 128 fp32 accumulators already fill 8 warps' registers). Tiles narrower than the
    stored ones (64-row down tiles) would need the weights packed again."""
    other_warps = 12 - cfg.num_warps  # 4 <-> 8
    configs = [
        cfg,
        replace(cfg, block_n_down=128 if cfg.block_n_down == 256 else 256, num_warps_down=None),
        replace(cfg, num_stages=4),
        replace(cfg, num_warps_down=12 - (cfg.num_warps_down or cfg.num_warps)),
        replace(cfg, group_m=1),
        replace(cfg, tiles_gate_up=1 if cfg.tiles_gate_up > 1 else 2),
    ]
    if cfg.block_m < 128:
        configs += [replace(cfg, num_warps=other_warps),
                    replace(cfg, block_n_gate_up=min(256, 2 * cfg.block_n_gate_up), num_warps=8)]
    return list(dict.fromkeys(configs))


def sweep_configs(num_experts: int, tokens: list[int], amd: bool) -> dict:
    """{launch configuration: the tokens per expert it is timed at}: for_load's choice at each M (AMD's on an
    AMD GPU) and its neighbours, so the sweep answers whether for_load is a local optimum, per model shape."""
    from kernels.backends.triton_moe import TritonConfig

    configs: dict = {}
    for m in tokens:
        chosen = TritonConfig.for_load(m * num_experts, num_experts, amd)
        for cfg in (decode_neighbours if m <= DECODE_MAX_TOKENS else prefill_neighbours)(chosen):
            if m not in configs.setdefault(cfg, []):
                configs[cfg].append(m)
    return configs


def triton_sweep(weights, problems, device, iters, peaks: Peaks) -> tuple[list[Row], list[dict]]:
    """for_load's configuration and its neighbours at each M, then the breakdown of for_load's choice per M.

    -> (rows, breakdown). Configurations with the same weight tiles share one packed copy of the weights.
    """
    from kernels.backends.base import is_rocm
    from kernels.backends.triton_moe import TritonExperts

    shape, amd = problems[0].shape, is_rocm(device)
    packed: dict = {}
    rows = []
    for config, tokens in sweep_configs(shape.experts, [p.tokens_per_expert for p in problems], amd).items():
        subset = [p for p in problems if p.tokens_per_expert in tokens]
        try:
            layout = (config.block_k, config.tile_n_gate_up, config.tile_n_down)
            if layout not in packed:
                packed[layout] = TritonExperts(weights, "silu", device, config)
            experts = packed[layout].configured(config)
            rows += run_backend("triton", weights, subset, device, iters, peaks, experts, _describe(config, True))
        except Exception as err:  # noqa: BLE001 -- one configuration that does not compile must not end the sweep
            print(f"  {_describe(config, True)} FAILED: {type(err).__name__}: {str(err)[:500]}", flush=True)
    return rows, triton_breakdown(TritonExperts(weights, "silu", device), problems, device, iters)


def triton_breakdown(experts, problems, device, iters) -> list[dict]:
    """Graph-replay time (us) of each launch alone (route, gate_up, down, combine) next to the whole call, and
    of torch's two stable sorts (by expert, by row) that a torch routing would need at least; the routing and the
    whole call also without the promise that the rows ascend (the rows then sorted too)."""
    shape = problems[0].shape
    out = []
    for p in problems:
        cfg = experts.config_for(p.pair_rows.numel())
        routes = experts.route(p.pair_rows, p.pair_experts, p.pair_weights, p.hidden.shape[0], True)
        act = experts.gate_up(p.hidden, routes, cfg)
        part = experts.down(act, routes, cfg)
        parts = {
            "route": lambda p=p: experts.route(p.pair_rows, p.pair_experts, p.pair_weights, p.hidden.shape[0], True),
            "route rows sorted": lambda p=p: experts.route(p.pair_rows, p.pair_experts, p.pair_weights,
                                                           p.hidden.shape[0]),
            "torch sorts": lambda p=p: (torch.sort(p.pair_experts, stable=True), torch.sort(p.pair_rows, stable=True)),
            "gate_up": lambda: experts.gate_up(p.hidden, routes, cfg),
            "down": lambda: experts.down(act, routes, cfg),
            "combine": lambda: experts.combine(part, routes, cfg),
            "all": lambda p=p: experts(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights, rows_ascending=True),
            "all rows sorted": lambda p=p: experts(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights),
        }
        times = {name: time_graph(fn, device, iters) for name, fn in parts.items()}
        out.append({"model": shape.name, "tokens_per_expert": p.tokens_per_expert, "config": _describe(cfg, True),
                    **{f"{name.replace(' ', '_')}_us": None if t is None else round(t * 1e6, 2)
                       for name, t in times.items()}})
        print("  " + _breakdown_line(out[-1]), flush=True)
    return out


def _breakdown_line(b: dict) -> str:
    times = ", ".join(f"{k[:-3].replace('_', ' ')} {v:.1f}" for k, v in b.items() if k.endswith("_us") and v is not None)
    return f"breakdown {b['model']} M={b['tokens_per_expert']} (us): {times}  [{b['config']}]"


def best_per_m(rows: list[Row]) -> list[dict]:
    """The fastest Triton row (graph time) per model and M, over the default run and the sweep."""
    best = {}
    for r in rows:
        if r.backend == "triton":
            key, t = (r.model, r.tokens_per_expert), r.graph_time_us or r.time_us
            if key not in best or t < (best[key].graph_time_us or best[key].time_us):
                best[key] = r
    return [{"model": r.model, "tokens_per_expert": r.tokens_per_expert, "graph_time_us": r.graph_time_us,
             "time_us": r.time_us, "fraction_of_copy": r.fraction_of_copy,
             "fraction_of_matmul": r.fraction_of_matmul, "config": r.config} for _, r in sorted(best.items())]


def _best_line(b: dict, default: Row | None) -> str:
    chosen = "" if default is None else (f"; for_load {default.graph_time_us} us, {default.fraction_of_copy:.1%} "
                                         f"copy, {default.fraction_of_matmul:.1%} mm")
    return (f"best {b['model']} M={b['tokens_per_expert']}: {b['graph_time_us']} us graph, "
            f"{b['fraction_of_copy']:.1%} of copy, {b['fraction_of_matmul']:.1%} of matmul: {b['config']}{chosen}")


def vllm_peer_rows(weights, problems, device, iters, peaks: Peaks, sweep_iters: int = 0) -> list[Row]:
    """vLLM's Triton int4 MoE kernel with vLLM's default launch parameters (and, sweep_iters > 0, tiles of 64-128
    above M = 16)."""
    from benchmarks.vllm_peer.layer import VllmTritonMoe

    shape = problems[0].shape
    peer = VllmTritonMoe(weights, shape.top_k, device)
    rows = run_backend("vllm_triton", weights, problems, device, iters, peaks, peer)
    large = [p for p in problems if p.tokens_per_expert > DECODE_MAX_TOKENS]
    for config in VLLM_SWEEP if sweep_iters and large else []:
        peer = VllmTritonMoe(weights, shape.top_k, device, config)
        rows += run_backend("vllm_triton", weights, large, device, sweep_iters, peaks, peer, _describe_dict(config))
    return rows


VLLM_SWEEP = [
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "SPLIT_K": 1,
     "num_warps": 8, "num_stages": 3},
    {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "SPLIT_K": 1,
     "num_warps": 8, "num_stages": 3},
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "SPLIT_K": 1,
     "num_warps": 4, "num_stages": 3},
]


def vllm_peer_check(device: torch.device) -> float:
    """Relative error of the peer against our reference on a small shape (E 8, H 256, I 128, top-2, M 4)."""
    from benchmarks.vllm_peer.layer import VllmTritonMoe

    shape = MoeShape("small", hidden=256, inter=128, experts=8, top_k=2)
    weights = random_weights(shape, device, seed=1)
    p = problem(shape, 4, device)
    out = VllmTritonMoe(weights, shape.top_k, device)(p.hidden, p.pair_rows, p.pair_experts, p.pair_weights)
    return _reference_error(out, p, weights)


def _describe(config, changed_only: bool = False) -> str:
    """key=value of a TritonConfig; changed_only: only where it differs from the default."""
    from kernels.backends.triton_moe import TritonConfig

    default = asdict(TritonConfig())
    return ",".join(f"{k}={v}" for k, v in asdict(config).items() if not changed_only or v != default[k]) or "default"


def _describe_dict(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


# ---- entry point -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_kernel.json"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", help=f"comma-separated of {', '.join(MODELS)} (default: all; CPU: qwen3-30b-a3b)")
    parser.add_argument("--tokens", help="tokens per expert, comma-separated (default: 1,2,4,8,16,64,128,256,1024; "
                        "CPU 1,8)")
    parser.add_argument("--backends", help="default: triton,hip_fdot2 on a GPU; cpu,reference on CPU")
    parser.add_argument("--no-peer", action="store_true", help="skip vLLM's Triton kernel (GPU)")
    parser.add_argument("--no-torch-int4", action="store_true", help="skip torch's int4 GEMM ceilings")
    parser.add_argument("--no-torch-bf16", action="store_true", help="skip the layer in dense bf16 through torch.bmm")
    parser.add_argument("--iters", type=int, help="default: 50 on a GPU, 3 on CPU")
    parser.add_argument("--threads", type=int, help="CPU threads (default 1 on CPU: on a shared 2-core box two "
                        "OpenMP threads measured 30x slower than one)")
    parser.add_argument("--sweep", action="store_true", help="also time for_load's Triton configuration and its "
                        "neighbours at each M (and a few of the vLLM peer's), and the graph time of each Triton launch "
                        "alone; both, and the best per M, go into the JSON and a closing summary (GPU)")
    parser.add_argument("--sweep-iters", type=int, default=20, help="iterations per sweep measurement")
    parser.add_argument("--summarize", type=Path, metavar="JSON", help="only print the closing summary of a results "
                        "file (e.g. one a timed-out run wrote after its first model)")
    args = parser.parse_args(argv)
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        _summary([Row(**r) for r in saved["results"]], saved.get("breakdown", []), saved.get("failures", []))
        return

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.threads or not gpu:
        torch.set_num_threads(args.threads or 1)
    iters = args.iters or (50 if gpu else 3)
    tokens = [int(t) for t in (args.tokens or ("1,2,4,8,16,64,128,256,1024" if gpu else "1,8")).split(",")]
    backends = (args.backends or ("triton,hip_fdot2" if gpu else "cpu,reference")).split(",")
    peaks = Peaks(copy_bandwidth(device, iters), matmul_flops(device, iters))
    print(f"device {torch.cuda.get_device_name(device) if gpu else platform.processor() or 'cpu'}: "
          f"copy {peaks.copy_bandwidth / 1e9:.0f} GB/s (read + write), matmul {peaks.matmul_flops / 1e12:.1f} TFLOP/s")

    meta = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton") if importlib.util.find_spec("triton") else None,
        "threads": torch.get_num_threads(),
        "copy_bandwidth_gbps": round(peaks.copy_bandwidth / 1e9, 1),
        "matmul_tflops": round(peaks.matmul_flops / 1e12, 1),
        "bandwidth_definition": "int4 payload + 16-bit group scales (group 128) / min(time, graph time)",
        "flop_definition": "2 * pairs * 3 * H * I / min(time, graph time); matmul: bf16 8192^3 torch.matmul",
        "iters": iters,
    }
    peer = gpu and not args.no_peer
    if peer:
        meta["vllm_peer_rel_error_small_shape"] = vllm_peer_check(device)
        print(f"vLLM peer against the reference (E 8, H 256, I 128, top-2, M 4): "
              f"relative error {meta['vllm_peer_rel_error_small_shape']:.1e}")
    rows: list[Row] = []
    breakdown: list[dict] = []
    failures: list[str] = []
    print(HEADER)
    for name in (args.models or (",".join(MODELS) if gpu else "qwen3-30b-a3b")).split(","):
        shape = MODELS[name] if gpu else replace(MODELS[name], experts=CPU_EXPERTS[name])
        weights = random_weights(shape, device)
        problems = [problem(shape, m, device) for m in tokens]
        print(f"{shape.name}: H={shape.hidden} I={shape.inter} E={shape.experts} top-{shape.top_k}, "
              f"{checkpoint_bytes(shape) / 1e6:.0f} MB of W4A16 weights")
        steps = [(b, lambda b=b: run_backend(b, weights, problems, device, iters if b != "reference" else 1, peaks))
                 for b in backends]
        if peer:
            steps.append(("vllm_triton", lambda: vllm_peer_rows(
                weights, problems, device, iters, peaks, args.sweep_iters if args.sweep else 0)))
        if not args.no_torch_int4:
            steps.append(("torch_int4", lambda: torch_int4_rows(weights, problems, device, iters, peaks)))
        if not args.no_torch_bf16:
            steps.append(("torch_bf16", lambda: torch_bf16_rows(weights, problems, device, iters, peaks)))
        if args.sweep and gpu:
            steps.append(("triton sweep", lambda: _sweep_rows(weights, problems, device, args.sweep_iters, peaks,
                                                              breakdown)))
        for label, step in steps:
            try:
                rows += step()
            except Exception as err:  # noqa: BLE001 -- one failing backend must not hide the others' numbers
                failures.append(f"{shape.name} {label}: {type(err).__name__}: {err}")
                print(f"  {label} FAILED: {type(err).__name__}: {str(err)[:2000]}", flush=True)
        del weights
        _write(args.out, meta, rows, breakdown, failures)
    _summary(rows, breakdown, failures)
    print(f"wrote {args.out}" + (f"; {len(failures)} failures" if failures else ""))


def _sweep_rows(weights, problems, device, iters, peaks: Peaks, breakdown: list[dict]) -> list[Row]:
    rows, parts = triton_sweep(weights, problems, device, iters, peaks)
    breakdown += parts
    return rows


def _summary(rows: list[Row], breakdown: list[dict], failures: list[str]) -> None:
    """The closing lines: per model and M the best Triton time (against for_load's in the default run), then
    the breakdown of for_load's choice, so a truncated log still ends with the answer."""
    default: dict = {}
    for r in rows:  # the default run comes before the sweep
        if r.backend == "triton":
            default.setdefault((r.model, r.tokens_per_expert), r)
    print("summary")
    for b in best_per_m(rows):
        print("  " + _best_line(b, default.get((b["model"], b["tokens_per_expert"]))))
    for b in breakdown:
        print("  " + _breakdown_line(b))
    for f in failures:
        print(f"  failure: {f[:300]}")


def _write(path: Path, meta: dict, rows: list[Row], breakdown: list[dict], failures: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in rows], "best": best_per_m(rows),
                                "breakdown": breakdown, "failures": failures}, indent=1))


if __name__ == "__main__":
    main()
