"""The numerical oracle as a backend: any device, every scheme the loaders produce."""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kernels import native_build
from kernels.activations import ACTIVATION_CODES
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


# At most this many pairs (a decode request: a row or two per expert), a CPU request runs in
# kernels/csrc/dense_experts.c; more, in torch's GEMMs, which reuse a weight tile over many rows
# better. Measured on the development machine (tiny Qwen3-MoE shapes, one thread): 1 row of one
# expert 7.6 us against 29, 8 rows of each of 2 experts 41 against 65, 64 rows of one 150 against 73.
SMALL_REQUEST_PAIRS = 16


@functools.cache
def _host_kernel() -> ctypes.CDLL:
    return native_build.load_host(native_build.build_host())


class DenseReference(PreparedExperts):
    """16-bit experts served unquantized: the oracle's float32 math (moe_experts_reference), with
    the weights converted to float32 once instead of per call.

    On the CPU a request of at most SMALL_REQUEST_PAIRS pairs is one call of the C kernel; a
    larger one runs the gathers, router weighting and sums on numpy views and the matmuls and the
    activation in torch (whose thread setting they follow). Either way the result is the same
    for the same request on every run.
    """

    def __init__(self, weights: DenseExpertWeights, activation: str) -> None:
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.hidden_size = weights.hidden_size
        self.num_experts = weights.num_experts
        self.w13t = [w.float().t().contiguous() for w in weights.w13]  # E x [H, 2I]
        self.w2t = [w.float().t().contiguous() for w in weights.w2]  # E x [I, H]
        self.intermediate = self.w2t[0].shape[0] if self.w2t else 0
        if weights.w13.device.type == "cpu":
            self._kernel = _host_kernel().hm_dense_experts
            self._w13t_ptrs = (ctypes.c_void_p * self.num_experts)(*(w.data_ptr() for w in self.w13t))
            self._w2t_ptrs = (ctypes.c_void_p * self.num_experts)(*(w.data_ptr() for w in self.w2t))
            self._act_code = ACTIVATION_CODES[activation]

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        if hidden.device.type != "cpu":
            return moe_sum(hidden, pair_rows, pair_experts, pair_weights, self.hidden_size,
                           lambda e: (self.w13t[e].t(), self.w2t[e].t()), self.activation)  # fmt: skip
        if pair_rows.shape[0] <= SMALL_REQUEST_PAIRS:
            return self._small(hidden, pair_rows, pair_experts, pair_weights)
        x = hidden.float().numpy()  # [T, H]
        rows, weights = pair_rows.numpy(), pair_weights.numpy()
        out = np.zeros((hidden.shape[0], self.hidden_size), dtype=np.float32)
        for e, pairs in pairs_by_expert(pair_experts):
            r = rows[pairs]  # unique within an expert, so `+=` below adds each row once
            gate, up = (torch.from_numpy(x[r]) @ self.w13t[e]).chunk(2, dim=-1)  # [R, I] each
            y = ((self.act(gate) * up) @ self.w2t[e]).numpy()  # [R, H]
            y *= weights[pairs][:, None]
            out[r] += y
        return torch.from_numpy(out)

    def _small(self, hidden, pair_rows, pair_experts, pair_weights) -> torch.Tensor:
        x = hidden.float().contiguous()
        rows, experts = pair_rows.long().contiguous(), pair_experts.long().contiguous()
        weights = pair_weights.float().contiguous()
        out = torch.empty(x.shape[0], self.hidden_size, dtype=torch.float32)
        status = self._kernel(x.data_ptr(), x.shape[0], self.hidden_size, self.intermediate, self.num_experts,
                              self._w13t_ptrs, self._w2t_ptrs, self._act_code, rows.data_ptr(), experts.data_ptr(),
                              weights.data_ptr(), rows.shape[0], out.data_ptr())  # fmt: skip
        if status == -2:
            raise MemoryError("dense_experts.c: no memory for a request's scratch buffers")
        if status != 0:  # the caller validated the pairs (LocalExperts.make_batch)
            raise ValueError(f"a pair names a row outside [0, {x.shape[0]}) or an expert outside "
                             f"[0, {self.num_experts})")
        return out
