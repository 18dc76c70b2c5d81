"""The numerical oracle as a backend: any device, every scheme the loaders produce."""
from __future__ import annotations

import numpy as np
import torch

from kernels.backends.base import ExpertBackend, PreparedExperts, Support
from kernels.quant import QuantScheme, W4A16ExpertWeights
from kernels.reference import ACTIVATIONS, DenseExpertWeights, moe_experts_w4a16_reference, moe_sum, pairs_by_expert


class ReferenceBackend(ExpertBackend):
    name = "reference"

    def supports_device(self, device: torch.device) -> Support:
        return Support.yes("plain PyTorch runs anywhere (dequantizes every used expert per call: slow)")

    def supports_quant_scheme(self, scheme: QuantScheme) -> Support:
        return Support.yes()

    def prepare(self, weights: W4A16ExpertWeights, activation: str, device: torch.device) -> PreparedExperts:
        return _Reference(weights.to(device), activation)


class _Reference(PreparedExperts):
    def __init__(self, weights: W4A16ExpertWeights, activation: str) -> None:
        self.weights = weights
        self.activation = activation

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        return moe_experts_w4a16_reference(
            hidden, pair_rows, pair_experts, pair_weights, self.weights, self.activation
        )


# A request whose pairs leave at most this many multiply-adds of unrequested (row, expert) products
# in its experts' full [rows x experts] grid runs as that grid, in two matmuls: cheaper than one
# Python iteration (a gather, two matmuls, a scatter) per expert, which costs about as much
# arithmetic on one core of the development machine (tiny models, decode-sized requests).
DENSE_GRID_WASTE_MACS = 1 << 19


class DenseReference(PreparedExperts):
    """16-bit experts served unquantized: the oracle's float32 math (moe_experts_reference), with
    the weights converted to float32 once instead of per call.

    On the CPU a small request (DENSE_GRID_WASTE_MACS) computes every (row, expert) of its grid:
    one matmul for all experts' gate and up projections, the router weights as a [T, E] matrix that
    is zero where a row did not pick an expert, one matmul for all down projections that also sums
    the experts. A larger one loops over its experts; the gathers, router weighting and sums run on
    numpy views, the matmuls and the activation in torch (whose thread setting they follow): each
    torch indexing operation costs several times numpy's on a few rows.
    """

    def __init__(self, weights: DenseExpertWeights, activation: str) -> None:
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.num_experts, self.hidden_size = weights.num_experts, weights.hidden_size
        self.inter = weights.w2.shape[2]
        self.w13_all = weights.w13.float().reshape(-1, self.hidden_size)  # [E*2I, H], expert by expert
        self.w2_all = weights.w2.float().transpose(1, 2).reshape(-1, self.hidden_size).contiguous()  # [E*I, H]
        self.w13 = list(self.w13_all.view(self.num_experts, 2 * self.inter, self.hidden_size))  # E x [2I, H]
        self.w2 = [w.t() for w in self.w2_all.view(self.num_experts, self.inter, self.hidden_size)]  # E x [H, I]
        self.grid_macs_per_row = self.num_experts * 3 * self.inter * self.hidden_size

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        if hidden.device.type != "cpu":
            return moe_sum(hidden, pair_rows, pair_experts, pair_weights, self.hidden_size,
                           lambda e: (self.w13[e], self.w2[e]), self.activation)  # fmt: skip
        num_pairs = pair_rows.shape[0]
        waste = hidden.shape[0] * self.grid_macs_per_row - num_pairs * (self.grid_macs_per_row // self.num_experts)
        if num_pairs and waste <= DENSE_GRID_WASTE_MACS:
            return self._grid(hidden, pair_rows, pair_experts, pair_weights)
        x = hidden.float().numpy()  # [T, H]
        rows, weights = pair_rows.numpy(), pair_weights.numpy()
        out = np.zeros((hidden.shape[0], self.hidden_size), dtype=np.float32)
        for e, pairs in pairs_by_expert(pair_experts):
            r = rows[pairs]  # unique within an expert, so `+=` below adds each row once
            gate, up = (torch.from_numpy(x[r]) @ self.w13[e].t()).chunk(2, dim=-1)  # [R, I] each
            y = ((self.act(gate) * up) @ self.w2[e].t()).numpy()  # [R, H]
            y *= weights[pairs][:, None]
            out[r] += y
        return torch.from_numpy(out)

    def _grid(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        num_rows = hidden.shape[0]
        gate_up = (hidden.float() @ self.w13_all.t()).view(num_rows, self.num_experts, 2, self.inter)
        h = self.act(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [T, E, I]
        coef = torch.zeros(num_rows, self.num_experts)  # the router weight of each (row, expert), 0 if unpicked
        coef[pair_rows.long(), pair_experts.long()] = pair_weights.float()
        h *= coef.unsqueeze(-1)
        return h.view(num_rows, -1) @ self.w2_all  # [T, H]: the experts summed inside the matmul
