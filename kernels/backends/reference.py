"""The numerical oracle as a backend: any device, every scheme the loaders produce."""
from __future__ import annotations

import numpy as np
import torch

from kernels.backends.base import ExpertBackend, PreparedExperts, Support
from kernels.quant import QuantScheme, W4A16ExpertWeights
from kernels.reference import ACTIVATIONS, DenseExpertWeights, moe_experts_w4a16_reference


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
    the weights converted to float32 and transposed once instead of per call.

    On the CPU the gathers, router weighting and sums run on numpy views, the matmuls and the
    activation in torch (whose thread setting they follow): a decode request is a row or two,
    where each torch indexing operation costs several times numpy's, and those per-operation
    costs are most of what a worker spends on it.
    """

    def __init__(self, weights: DenseExpertWeights, activation: str) -> None:
        self.act = ACTIVATIONS[activation]
        self.hidden_size = weights.hidden_size
        self.intermediate = weights.w2.shape[2]
        self.w13 = [w.float().t().contiguous() for w in weights.w13]  # E x [H, 2I]
        self.w2 = [w.float().t().contiguous() for w in weights.w2]  # E x [I, H]

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        if hidden.device.type == "cpu":
            return self._host(hidden, pair_rows, pair_experts, pair_weights)
        x = hidden.float()
        out = torch.zeros(hidden.shape[0], self.hidden_size, device=hidden.device)
        experts, i = pair_experts.tolist(), self.intermediate  # one host sync; decode requests hold a few pairs
        for e in sorted(set(experts)):
            pairs = torch.tensor([p for p, v in enumerate(experts) if v == e], device=hidden.device)
            rows = pair_rows[pairs]
            gate_up = x[rows] @ self.w13[e]  # [R, 2I]
            y = (self.act(gate_up[:, :i]) * gate_up[:, i:]) @ self.w2[e]  # [R, H]
            out.index_add_(0, rows, y * pair_weights[pairs].unsqueeze(-1))
        return out

    def _host(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        x = hidden.float().numpy()  # [T, H]
        rows, weights = pair_rows.numpy(), pair_weights.numpy()
        out = np.zeros((hidden.shape[0], self.hidden_size), dtype=np.float32)
        experts, i = pair_experts.tolist(), self.intermediate
        for e in sorted(set(experts)):
            pairs = [p for p, v in enumerate(experts) if v == e]
            r = rows[pairs]  # unique within an expert, so `+=` below adds each row once
            gate_up = torch.from_numpy(x[r]) @ self.w13[e]  # [R, 2I]
            y = ((self.act(gate_up[:, :i]) * gate_up[:, i:]) @ self.w2[e]).numpy()  # [R, H]
            y *= weights[pairs][:, None]
            out[r] += y
        return torch.from_numpy(out)
