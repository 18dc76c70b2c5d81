"""CPU backend: torch's int4 CPU GEMM (`_weight_int4pack_mm_for_cpu`), one call per used expert.

Measured on the 2-core AVX2 development machine (one thread, [1536 x 2048] int4 GEMV):
bf16 activations 0.46 ms, fp16 6.5 ms, fp32 14 ms, dequantize + fp32 matmul ~20-35 ms;
so activations and scales run in bf16 and the activation between the GEMMs is fp32.
The kernel wants N divisible by 16: rows are padded with zero-scale weights.
"""
from __future__ import annotations

import torch

from kernels.backends.base import ExpertBackend, PairsByExpert, PreparedExperts, Support, symmetric_int4_support
from kernels.quant import Int4Weights, QuantScheme, W4A16ExpertWeights
from kernels.reference import ACTIVATIONS

GROUP_SIZES = (32, 64, 128, 256)
N_MULTIPLE = 16
COMPUTE_DTYPE = torch.bfloat16


class CpuBackend(ExpertBackend):
    name = "cpu"

    def supports_device(self, device: torch.device) -> Support:
        if device.type != "cpu":
            return Support.no(f"device {device} is not the CPU")
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return Support.no(f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu")
        return Support.yes()

    def supports_quant_scheme(self, scheme: QuantScheme) -> Support:
        return symmetric_int4_support(scheme, GROUP_SIZES)

    def prepare(self, weights: W4A16ExpertWeights, activation: str, device: torch.device) -> PreparedExperts:
        return _CpuExperts(weights, activation)


class _Int4Projection:
    """One projection of all experts in the CPU kernel's layout."""

    def __init__(self, weights: Int4Weights) -> None:
        self.out_features = weights.out_features
        self.group_size = weights.group_size
        pad = -self.out_features % N_MULTIPLE
        packed, scales_and_zeros = [], []
        for e in range(weights.num_experts):
            q = torch.nn.functional.pad(weights.unpacked(e).to(torch.int32), (0, 0, 0, pad), value=8)  # [Np, K]
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))  # [Np, K/2] uint8
            scale = torch.nn.functional.pad(weights.scales[e].float(), (0, 0, 0, pad))  # [Np, K/G]
            # the kernel computes (q - 8) * scale + zero; zero = 0 keeps it symmetric
            scales_and_zeros.append(torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1))  # [K/G, Np, 2]
        self.packed = torch.stack(packed)  # [E, Np, K/2]
        self.scales_and_zeros = torch.stack(scales_and_zeros).to(COMPUTE_DTYPE).contiguous()  # [E, K/G, Np, 2]

    def __call__(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [R, K] bf16 -> [R, N] float32."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed[expert], self.group_size, self.scales_and_zeros[expert]
        )  # [R, Np]
        return y[:, : self.out_features].float()


class _CpuExperts(PreparedExperts):
    def __init__(self, weights: W4A16ExpertWeights, activation: str) -> None:
        self.num_experts = weights.num_experts
        self.hidden_size = weights.hidden_size
        self.act = ACTIVATIONS[activation]
        self.w13 = _Int4Projection(weights.w13)
        self.w2 = _Int4Projection(weights.w2)

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights, *, rows_ascending=False) -> torch.Tensor:
        x = hidden.to(COMPUTE_DTYPE)  # [T, H]
        out = torch.zeros(hidden.shape[0], self.hidden_size, dtype=torch.float32)
        groups = PairsByExpert.group(pair_experts, self.num_experts)
        bounds = groups.bounds.tolist()
        for e in range(self.num_experts):
            if bounds[e] == bounds[e + 1]:
                continue
            pairs = groups.order[bounds[e] : bounds[e + 1]].long()  # [R]
            rows = pair_rows[pairs]  # [R]
            gate, up = self.w13(x[rows], e).chunk(2, dim=-1)  # [R, I] each
            y = self.w2((self.act(gate) * up).to(COMPUTE_DTYPE), e)  # [R, H]
            out.index_add_(0, rows, y * pair_weights[pairs].float().unsqueeze(-1))
        return out
