"""hip_fdot2 backend: the HIP/CUDA GEMV kernel of kernels/csrc/w4a16_fdot2.cu, loaded with ctypes.

On RDNA2 (gfx103x) it is the fast path: fdot2, wave32, no WMMA needed. On NVIDIA the same source
builds with nvcc (fdot2 becomes two fp32 FMAs) so its logic is tested on real hardware; there the
oracle prefers Triton. Activations run in fp16 (fdot2 takes fp16 pairs). Every sum has a fixed
order (no float atomics): the output is bitwise identical run to run.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels import native_build
from kernels.backends.base import (
    ExpertBackend, PairsByExpert, PairsByRow, PreparedExperts, Support, symmetric_int4_support,
)
from kernels.quant import QuantScheme, W4A16ExpertWeights

from kernels.activations import ACTIVATION_CODES
MIN_CUDA_CAPABILITY = (7, 0)
GROUP_SIZES = (32, 64, 128, 256)


class HipFdot2Backend(ExpertBackend):
    name = "hip_fdot2"

    def __init__(self, archs: tuple[str, ...] | None = None, cache_dir: Path = native_build.DEFAULT_CACHE) -> None:
        """archs: build for these architectures (a pool-wide build); None builds for the device's own."""
        self.archs = archs
        self.cache_dir = cache_dir

    def supports_device(self, device: torch.device) -> Support:
        if device.type != "cuda" or not torch.cuda.is_available():
            return Support.no(f"device {device} is not a GPU")
        platform = native_build.device_platform()
        arch = native_build.device_arch(device)
        if platform == "hip" and not (arch.startswith("gfx103") or arch.startswith("gfx11")):
            return Support.no(f"{arch} is not RDNA2/RDNA3 (v_dot2_f32_f16 with wave32)")
        if platform == "cuda" and torch.cuda.get_device_capability(device) < MIN_CUDA_CAPABILITY:
            return Support.no(f"{arch} is older than sm_70")
        if native_build.compiler(platform) is None:
            return Support.no(f"no {'hipcc' if platform == 'hip' else 'nvcc'} to build the kernel")
        if self.archs is not None and arch not in self.archs:
            return Support.no(f"the kernel build is for {', '.join(self.archs)}, not this device's {arch}")
        return Support.yes()

    def supports_quant_scheme(self, scheme: QuantScheme) -> Support:
        return symmetric_int4_support(scheme, GROUP_SIZES)

    def build(self, platform: str, archs: tuple[str, ...]) -> native_build.KernelBuild:
        """The library prepare loads; kernels.hip_isa inspects the ISA of this same call's output."""
        return native_build.build(platform, archs, self.cache_dir)

    def prepare(self, weights: W4A16ExpertWeights, activation: str, device: torch.device) -> PreparedExperts:
        kernel = self.build(native_build.device_platform(), self.archs or (native_build.device_arch(device),))
        native_build.check_arch(kernel, device)
        return _Fdot2Experts(weights, activation, device, native_build.load(kernel))


class _Fdot2Experts(PreparedExperts):
    def __init__(self, weights: W4A16ExpertWeights, activation: str, device: torch.device, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.device = device
        self.activation = ACTIVATION_CODES[activation]
        self.num_experts = weights.num_experts
        self.hidden_size = weights.hidden_size
        self.intermediate_size = weights.intermediate_size
        self.group_size = weights.w13.group_size
        # the kernel reads the canonical layout as is: packed [E, N, K/8], scales [E, N, K/G] fp32
        self.w13 = weights.w13.packed.to(device).contiguous()
        self.s13 = weights.w13.scales.to(device=device, dtype=torch.float32).contiguous()
        self.w2 = weights.w2.packed.to(device).contiguous()
        self.s2 = weights.w2.scales.to(device=device, dtype=torch.float32).contiguous()

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights, *, rows_ascending=False) -> torch.Tensor:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        num_pairs, num_rows = pair_rows.numel(), hidden.shape[0]
        x = hidden.to(torch.float16).contiguous()  # [T, H]
        rows = pair_rows.to(torch.int32).contiguous()
        router = pair_weights.to(torch.float32).contiguous()
        groups = PairsByExpert.group(pair_experts, e)
        by_row = PairsByRow.group(pair_rows, num_rows)
        step = tokens_per_step(num_pairs, e)
        workspace = torch.empty(self.lib.hm_fdot2_workspace_floats(num_pairs, h, i, step), dtype=torch.float32,
                                device=x.device)  # fmt: skip
        out = torch.empty(num_rows, h, dtype=torch.float32, device=x.device)  # [T, H], every element written
        status = self.lib.hm_fdot2_moe(
            x.data_ptr(), rows.data_ptr(), router.data_ptr(), groups.order.data_ptr(), groups.bounds.data_ptr(),
            by_row.order.data_ptr(), by_row.bounds.data_ptr(),
            self.w13.data_ptr(), self.s13.data_ptr(), self.w2.data_ptr(), self.s2.data_ptr(),
            workspace.data_ptr(), out.data_ptr(),
            e, num_pairs, num_rows, h, i, self.group_size, step, self.activation,
            torch.cuda.current_stream(x.device).cuda_stream,
        )
        if status != 0:
            raise RuntimeError(f"hm_fdot2_moe launch failed with runtime error {status}")
        return out


def tokens_per_step(num_pairs: int, num_experts: int) -> int:
    """Rows staged per step (1, 2, 4, 8): the average pairs per expert, rounded up to a power of two."""
    per_expert = -(-num_pairs // num_experts)
    step = 1
    while step < per_expert and step < 8:
        step *= 2
    return step
