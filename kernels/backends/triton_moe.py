"""Triton backend: grouped W4A16 MoE on CUDA and ROCm (gfx11) GPUs, two launches per layer.

    pairs --sort by expert--> order, bounds
    gate_up_kernel: x[rows] @ w13[e]^T -> act(gate) * up        [P, I]  (fp16/bf16)
    down_kernel:    act @ w2[e]^T * router weight -> atomic add  [T, H]  (fp32)
Kernels and weight layout: kernels/triton_w4a16.py.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from kernels.backends.base import ExpertBackend, PairsByExpert, PreparedExperts, Support
from kernels.quant import Int4Weights, QuantScheme, W4A16ExpertWeights, unpack_int4

GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Launch parameters; `for_load` picks them from the average pairs per expert.

    H200, Qwen3-30B-A3B shapes (results/bench_kernel_h200.json sweep): the default was the best
    or within 1% of it at 1-16 tokens per expert; at 64, block_m=32 took 572 us against 654 us
    for 16 and 806 us for block_m=64 with 8 warps (which compiles to wgmma and stages the
    dequantized weights through shared memory).
    """

    block_m: int = 16
    block_n_gate_up: int = 64
    block_n_down: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ptx_dequant: bool = True  # CUDA only: PTX nibble unpacking (kernels/triton_w4a16.py)

    @classmethod
    def for_load(cls, num_pairs: int, num_experts: int) -> TritonConfig:
        per_expert = -(-num_pairs // num_experts)
        return cls() if per_expert <= 16 else cls(block_m=32)


class TritonBackend(ExpertBackend):
    name = "triton"

    def supports_device(self, device: torch.device) -> Support:
        if device.type != "cuda":
            return Support.no(f"device {device} is not a CUDA/ROCm GPU")
        if importlib.util.find_spec("triton") is None:
            return Support.no("triton is not installed")
        if not torch.cuda.is_available():
            return Support.no("torch sees no GPU")
        return Support.yes()

    def supports_quant_scheme(self, scheme: QuantScheme) -> Support:
        if scheme.bits != 4 or not scheme.symmetric:
            return Support.no(f"{scheme.describe()}: the kernel hard-codes zero 8 (symmetric int4)")
        if scheme.act_order:
            return Support.no(f"{scheme.describe()}: act-order g_idx is not supported")
        if scheme.group_size not in GROUP_SIZES:
            return Support.no(f"{scheme.describe()}: group size must be one of {GROUP_SIZES}")
        return Support.yes()

    def prepare(self, weights: W4A16ExpertWeights, activation: str, device: torch.device) -> PreparedExperts:
        return TritonExperts(weights, activation, device)


@dataclass(frozen=True, slots=True)
class TritonProjection:
    """w [E, N, K/2] uint8 in group-block nibble order, s [E, K/G, N] fp32."""

    w: torch.Tensor
    s: torch.Tensor
    group_size: int

    @classmethod
    def from_int4(cls, weights: Int4Weights, device: torch.device) -> TritonProjection:
        g = weights.group_size
        blocks = []
        for e in range(weights.num_experts):
            q = unpack_int4(weights.packed[e].to(device))  # [N, K]
            q = q.unflatten(-1, (-1, 2, g // 2))  # [N, K/G, 2, G/2]
            blocks.append((q[..., 0, :] | (q[..., 1, :] << 4)).flatten(-2))  # [N, K/2]
        scales = weights.scales.to(device=device, dtype=torch.float32).transpose(1, 2).contiguous()
        return cls(torch.stack(blocks), scales, g)


class TritonExperts(PreparedExperts):
    def __init__(
        self, weights: W4A16ExpertWeights, activation: str, device: torch.device,
        config: TritonConfig | None = None,
    ) -> None:
        from kernels import triton_w4a16  # imports triton: only once a GPU layer is prepared

        self.kernels = triton_w4a16
        self.activation = triton_w4a16.ACTIVATION_CODES[activation]
        self.num_experts = weights.num_experts
        self.hidden_size = weights.hidden_size
        self.intermediate_size = weights.intermediate_size
        self.w13 = TritonProjection.from_int4(weights.w13, device)
        self.w2 = TritonProjection.from_int4(weights.w2, device)
        self.config = config

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        x = hidden if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.to(torch.bfloat16)
        x = x.contiguous()  # [T, H]
        num_pairs = pair_rows.numel()
        cfg = self.config or TritonConfig.for_load(num_pairs, e)
        groups = PairsByExpert.group(pair_experts, e)
        router = pair_weights.to(torch.float32)
        act = torch.empty(num_pairs, i, dtype=x.dtype, device=x.device)  # [P, I]
        out = torch.zeros(x.shape[0], h, dtype=torch.float32, device=x.device)  # [T, H]
        is_bf16 = x.dtype == torch.bfloat16
        use_ptx = cfg.ptx_dequant and x.is_cuda and torch.version.hip is None
        w13, w2 = self.w13, self.w2
        self.kernels.gate_up_kernel[(e, _cdiv(i, cfg.block_n_gate_up))](
            x, x.stride(0),
            pair_rows, groups.order, groups.bounds,
            w13.w, w13.w.stride(0), w13.w.stride(1),
            w13.s, w13.s.stride(0), w13.s.stride(1),
            act, act.stride(0),
            i, h,
            GROUP=w13.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up,
            ACTIVATION=self.activation, IS_BF16=is_bf16, USE_PTX=use_ptx,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        self.kernels.down_kernel[(e, _cdiv(h, cfg.block_n_down))](
            act, act.stride(0),
            pair_rows, router, groups.order, groups.bounds,
            w2.w, w2.w.stride(0), w2.w.stride(1),
            w2.s, w2.s.stride(0), w2.s.stride(1),
            out, out.stride(0),
            h, i,
            GROUP=w2.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, IS_BF16=is_bf16, USE_PTX=use_ptx,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
