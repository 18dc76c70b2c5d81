"""AMD guard for the Triton backend: compile its kernels for gfx11 as TritonExperts launches them, and read the ISA.

No AMD GPU is needed: the triton wheel carries Triton's AMD backend, which compiles for a named target. Layers run
on CPU tensors with every launch replaced by Triton's warm-up of the same call (JITFunction.warmup: the launch's
binding, specialization, constexprs and options, compiled and not run) while the active Triton driver names the
AMD target, so the code objects read are those a gfx11 GPU is given for the same shapes; nothing is computed.
Per distinct compiled kernel the rules are: wave32, no scratch memory (where spilled registers go: a memory
access per use), and WMMA in the GEMMs (gate_up_kernel, down_kernel). RDNA2 (gfx103x) is no target: Triton has
no backend for it, which TritonBackend.supports_device finds by compiling for the GPU's own target (and the
oracle puts hip_fdot2 first there).

    python -m kernels.triton_isa [--arch gfx1100] [--out DIR]
exits 1 when a kernel fails to compile or breaks a rule.
"""
from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.hip_isa import WAVEFRONT_SIZE, WMMA, per_arch_command
from kernels.quant import W4A16ExpertWeights, quantize_symmetric

TARGETS = ("gfx1100",)
GEMMS = ("gate_up_kernel", "down_kernel")
_NOTES = {  # the code object's metadata, as the amdgcn text carries it
    "vgprs": re.compile(r"^\s*\.vgpr_count:\s+(\d+)", re.MULTILINE),
    "vgpr_spills": re.compile(r"^\s*\.vgpr_spill_count:\s+(\d+)", re.MULTILINE),
    "scratch_bytes": re.compile(r"^\s*\.private_segment_fixed_size:\s+(\d+)", re.MULTILINE),
    "wavefront_size": WAVEFRONT_SIZE,
    "occupancy": re.compile(r"^; Occupancy:\s+(\d+)", re.MULTILINE),
}


@dataclass(frozen=True, slots=True)
class KernelIsa:
    """One compiled kernel's facts and the rules it breaks (`problems`, empty when none)."""

    kernel: str
    launch: str  # the launch's constexpr arguments and warps: what tells a kernel's compiled variants apart
    vgprs: int
    vgpr_spills: int
    scratch_bytes: int  # per lane
    occupancy: int  # waves per SIMD that its registers and LDS allow
    wmma_count: int
    wave32: bool
    problems: tuple[str, ...]


def inspect(kernel: str, launch: str, isa: str) -> KernelIsa:
    """Applies the rules to one kernel's amdgcn text (code and metadata)."""
    notes = {name: [int(v) for v in pattern.findall(isa)] for name, pattern in _NOTES.items()}
    wmma = len(WMMA.findall(isa))
    wave32 = notes["wavefront_size"] == [32]
    scratch, spills = max(notes["scratch_bytes"], default=0), max(notes["vgpr_spills"], default=0)
    problems = []
    if not wave32:
        problems.append(f"not wave32 (wavefront sizes {notes['wavefront_size'] or 'none found'})")
    if scratch:
        problems.append(f"{scratch} bytes of scratch per lane ({spills} VGPRs spilled)")
    if kernel in GEMMS and not wmma:
        problems.append("no WMMA instruction in a GEMM")
    return KernelIsa(kernel, launch, max(notes["vgprs"], default=0), spills, scratch,
                     min(notes["occupancy"], default=0), wmma, wave32, tuple(problems))  # fmt: skip


class _AheadOfTime:
    """A Triton driver that only names a target: kernels bind and compile for it and are never launched."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("hip", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(arch: str):
    """Inside, Triton binds and compiles for the AMD GPU `arch`. The kernels' per-device bindings are dropped on
    the way in and out, so none made for another target is reused."""
    import triton
    from triton.runtime.jit import JITFunction

    from kernels import triton_w4a16

    kernels = [v for v in vars(triton_w4a16).values() if isinstance(v, JITFunction)]
    for k in kernels:
        k.device_caches.clear()
    driver = triton.runtime.driver
    before = driver._active  # None until a launch asks; reset_active() would look for a GPU driver
    driver.set_active(_AheadOfTime(arch))
    try:
        yield
    finally:
        driver.set_active(before)
        for k in kernels:
            k.device_caches.clear()


class Warmups:
    """Stands in for kernels.triton_w4a16 in a TritonExperts (its `kernels`): `kernel[grid](*args, **kwargs)`
    compiles that launch (Triton's warm-up of the same call) and keeps the compiled kernel in `compiled`, keyed by
    (kernel name, launch)."""

    def __init__(self):
        from kernels import triton_w4a16

        self._module = triton_w4a16
        self.compiled: dict[tuple[str, str], object] = {}

    def __getattr__(self, name: str) -> _WarmUp:
        return _WarmUp(name, getattr(self._module, name), self.compiled)


@dataclass(frozen=True, slots=True)
class _WarmUp:
    """`kernel[grid](*args, **kwargs)` of one kernel, compiled into `compiled` instead of launched."""

    name: str
    fn: object  # the kernel's JITFunction
    compiled: dict

    def __getitem__(self, grid):
        def warm_up(*args, **kwargs):
            kernel = self.fn.warmup(*args, grid=grid, **kwargs)
            constexprs = {p.name: kwargs[p.name] for p in self.fn.params if p.is_constexpr and p.name in kwargs}
            launch = {**constexprs, "num_warps": kernel.metadata.num_warps}
            key = ", ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in launch.items())
            self.compiled[(self.name, key)] = kernel

        return warm_up


# The layers: hidden and intermediate sizes multiples of 128 (as Qwen3-30B-A3B's 2048 / 768 and Mixtral's 4096 /
# 14336: the same EVEN_K / EVEN_N), group 128, the two kinds of layer for_load tells apart (many small experts,
# top-8 of 128; few large ones, top-2 of 8), at pairs per expert on both sides of its thresholds and up to where
# the routing counts and sorts rows in several passes, with rows ascending (how workers call it) and not.
LAYERS = ((128, 8), (8, 2))  # (experts, top-k)
PAIRS_PER_EXPERT = (1, 16, 32, 64, 128)
HIDDEN, INTERMEDIATE, GROUP = 256, 256, 128


def layer(num_experts: int, seed: int = 0) -> W4A16ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return W4A16ExpertWeights(
        quantize_symmetric(torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=g), GROUP),
        quantize_symmetric(torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=g), GROUP),
    )


def call(experts, top_k: int, pairs_per_expert: int, rows_ascending: bool) -> None:
    """One call of `experts` (a TritonExperts) whose every expert gets pairs_per_expert pairs."""
    tokens = pairs_per_expert * experts.num_experts // top_k
    flat = torch.arange(tokens * top_k, dtype=torch.int32)
    hidden = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    experts(hidden, flat // top_k, flat % experts.num_experts, torch.ones(flat.numel()), rows_ascending=rows_ascending)


def compile_backend(arch: str) -> dict[tuple[str, str], object]:
    """(kernel name, launch) -> Triton CompiledKernel for `arch`, over every launch of LAYERS' calls, with the
    configurations TritonExperts takes on AMD GPUs."""
    from kernels.backends.triton_moe import TritonExperts

    warmups = Warmups()
    with compiling_for(arch):
        for num_experts, top_k in LAYERS:
            experts = TritonExperts(layer(num_experts), "silu", torch.device("cpu"), amd=True)
            experts.kernels = warmups
            for m in PAIRS_PER_EXPERT:
                for ascending in (True, False):
                    call(experts, top_k, m, ascending)
    return warmups.compiled


def check(arch: str) -> list[tuple[KernelIsa, str]]:
    """(facts, amdgcn text) of every kernel compile_backend compiles for `arch`, by kernel name and launch."""
    return [(inspect(name, launch, kernel.asm["amdgcn"]), kernel.asm["amdgcn"])
            for (name, launch), kernel in sorted(compile_backend(arch).items())]  # fmt: skip


def _check_backend(arch: str, out: Path | None) -> bool:
    try:
        results = check(arch)
    except Exception as err:  # noqa: BLE001 -- a kernel Triton cannot compile for arch: its error, whatever the stage
        print(f"{arch}: FAIL {type(err).__name__}: {err}")
        return True
    for n, (r, isa) in enumerate(results):
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{arch}-{r.kernel}-{n}.s").write_text(isa)
        print(f"{arch} {r.kernel}: {'FAIL ' + '; '.join(r.problems) if r.problems else 'ok'} (VGPRs {r.vgprs}, "
              f"scratch {r.scratch_bytes} B, occupancy {r.occupancy}, WMMA {r.wmma_count}) [{r.launch}]")
    return any(r.problems for r, _ in results)


def main(argv: list[str] | None = None) -> int:
    return per_arch_command(argv, __doc__, TARGETS, "write each kernel's amdgcn to <arch>-<kernel>-<n>.s here",
                            _check_backend)


if __name__ == "__main__":
    sys.exit(main())
