"""The numerical oracle as a backend: any device, every scheme the loaders produce."""
from __future__ import annotations

import ctypes

import torch

from kernels import native_build
from kernels.activations import ACTIVATION_CODES
from kernels.backends.base import ExpertBackend, FrameKernel, PreparedExperts, Support
from kernels.quant import QuantScheme, W4A16ExpertWeights
from kernels.reference import DenseExpertWeights, moe_experts_w4a16_reference, moe_sum


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

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights, *, rows_ascending=False) -> torch.Tensor:
        return moe_experts_w4a16_reference(
            hidden, pair_rows, pair_experts, pair_weights, self.weights, self.activation
        )


class DenseReference(PreparedExperts):
    """16-bit experts served unquantized: the oracle's float32 math (moe_experts_reference), with
    the weights converted to float32 once instead of per call.

    On the CPU each request is one call of the C kernel (kernels/csrc/dense_experts.c), from its
    tensors or from the frame that carried it (forward_frame): a decode request costs a few
    microseconds, where torch's dispatches cost tens, and every row's partial has the same bits
    whatever else the request holds. One thread: on the development machine it matched torch's
    GEMMs up to 64 rows of an expert and took 1.4x their time at 128 (tiny Qwen3-MoE shapes).
    """

    def __init__(self, weights: DenseExpertWeights, activation: str) -> None:
        self.activation = activation
        self.hidden_size = weights.hidden_size
        self.num_experts = weights.num_experts
        self.w13t = [w.float().t().contiguous() for w in weights.w13]  # E x [H, 2I]
        self.w2t = [w.float().t().contiguous() for w in weights.w2]  # E x [I, H]
        self.intermediate = self.w2t[0].shape[0] if self.w2t else 0
        self._lib = native_build.host_library() if weights.w13.device.type == "cpu" else None
        self._frame_kernel = None
        if self._lib is not None:
            self._w13t_ptrs = (ctypes.c_void_p * self.num_experts)(*(w.data_ptr() for w in self.w13t))
            self._w2t_ptrs = (ctypes.c_void_p * self.num_experts)(*(w.data_ptr() for w in self.w2t))
            self._act_code = ACTIVATION_CODES[activation]
            self._frame_kernel = FrameKernel(self._lib.hm_dense_frame, ctypes.addressof(self._w13t_ptrs),
                                             ctypes.addressof(self._w2t_ptrs), self.hidden_size, self.intermediate,
                                             self.num_experts, self._act_code)  # fmt: skip

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights, *, rows_ascending=False) -> torch.Tensor:
        if hidden.device.type != "cpu":
            return moe_sum(hidden, pair_rows, pair_experts, pair_weights, self.hidden_size,
                           lambda e: (self.w13t[e].t(), self.w2t[e].t()), self.activation)  # fmt: skip
        x = hidden.float().contiguous()
        rows, experts = pair_rows.long().contiguous(), pair_experts.long().contiguous()
        weights = pair_weights.float().contiguous()
        out = torch.empty(x.shape[0], self.hidden_size, dtype=torch.float32)
        status = self._lib.hm_dense_experts(x.data_ptr(), x.shape[0], self.hidden_size, self.intermediate,
                                            self.num_experts, self._w13t_ptrs, self._w2t_ptrs, self._act_code,
                                            rows.data_ptr(), experts.data_ptr(), weights.data_ptr(), rows.shape[0],
                                            out.data_ptr())  # fmt: skip
        if status == -2:
            raise MemoryError("dense_experts.c: no memory for a request's scratch buffers")
        if status != 0:  # the caller validated the pairs (LocalExperts.make_batch)
            raise ValueError(f"a pair names a row outside [0, {x.shape[0]}) or an expert outside "
                             f"[0, {self.num_experts})")
        return out

    def frame_kernel(self) -> FrameKernel | None:
        """hm_dense_frame on the CPU: __call__'s kernel, which checks the pairs itself."""
        return self._frame_kernel
