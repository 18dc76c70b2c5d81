"""The numerical oracle as a backend: any device, every scheme the loaders produce."""
from __future__ import annotations

import torch

from kernels.backends.base import ExpertBackend, PreparedExperts, Support
from kernels.quant import QuantScheme, W4A16ExpertWeights
from kernels.reference import DenseExpertWeights, moe_experts_reference, moe_experts_w4a16_reference


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
    """16-bit experts served unquantized, through the float32 oracle."""

    def __init__(self, weights: DenseExpertWeights, activation: str) -> None:
        self.weights = weights
        self.activation = activation

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        return moe_experts_reference(hidden, pair_rows, pair_experts, pair_weights, self.weights, self.activation)
