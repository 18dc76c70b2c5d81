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


class DenseReference(PreparedExperts):
    """16-bit experts served unquantized: the oracle's float32 math (moe_experts_reference), with
    the weights converted to float32 once instead of per call.

    On the CPU the gathers, router weighting and sums run on numpy views, the matmuls and the
    activation in torch (whose thread setting they follow): a decode request is a row or two,
    where each torch indexing operation costs several times numpy's, and those per-operation
    costs are most of what a worker spends on it.
    """

    def __init__(self, weights: DenseExpertWeights, activation: str) -> None:
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.hidden_size = weights.hidden_size
        self.w13 = [w.float() for w in weights.w13]  # E x [2I, H]
        self.w2 = [w.float() for w in weights.w2]  # E x [H, I]

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        if hidden.device.type != "cpu":
            return moe_sum(hidden, pair_rows, pair_experts, pair_weights, self.hidden_size,
                           lambda e: (self.w13[e], self.w2[e]), self.activation)  # fmt: skip
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
