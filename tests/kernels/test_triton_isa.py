"""AMD guard for the Triton backend: every kernel TritonExperts launches, compiled for gfx1100 by Triton's AMD
backend exactly as it would launch there (kernels.triton_isa), runs wave32 without scratch, and its GEMMs use WMMA.
On the CPU: nothing is launched, only compiled."""
from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction

from kernels import triton_isa, triton_w4a16
from kernels.backends.triton_moe import TritonConfig, TritonExperts, compile_refusal

LAUNCHED = {name for name, v in vars(triton_w4a16).items()
            if isinstance(v, JITFunction) and name.endswith("_kernel") and name != "target_probe_kernel"}  # fmt: skip


def _compile_call(experts, arch: str, top_k: int, pairs_per_expert: int) -> dict:
    """(kernel name, launch) -> compiled kernel, for `arch`, of one call of `experts` (rows ascending)."""
    experts.kernels = warmups = triton_isa.Warmups()
    with triton_isa.compiling_for(arch):
        triton_isa.call(experts, top_k, pairs_per_expert, rows_ascending=True)
    return warmups.compiled


def test_every_kernel_compiles_for_gfx1100_wave32_without_scratch():
    reports = [r for r, _ in triton_isa.check("gfx1100")]
    assert {r.kernel for r in reports} == LAUNCHED, "a kernel the backend launches was not compiled"
    assert [(r.kernel, r.launch, r.problems) for r in reports if r.problems] == []
    gemms = [r for r in reports if r.kernel in triton_isa.GEMMS]
    assert len(gemms) >= 4 and all(r.wmma_count > 0 and r.vgprs <= 256 for r in gemms)


def test_nvidia_configuration_spills_on_gfx1100():
    """The rule bites on real compiler output: NVIDIA's configuration for 64 pairs per expert (64-row swapped
    blocks, 3 stages), compiled for gfx1100, needs scratch; AMD's for the same load does not."""
    experts = TritonExperts(triton_isa.layer(128), "silu", torch.device("cpu"), amd=True)
    reports = {}
    for amd in (False, True):
        compiled = _compile_call(experts.configured(TritonConfig.for_load(64 * 128, 128, amd)), "gfx1100", 8, 64)
        (launch, kernel), = [(launch, k) for (name, launch), k in compiled.items() if name == "gate_up_kernel"]
        reports[amd] = triton_isa.inspect("gate_up_kernel", launch, kernel.asm["amdgcn"])
    assert reports[False].scratch_bytes > 0 and "scratch" in " ".join(reports[False].problems)
    assert reports[True].problems == ()


def test_inspect_flags_wave64_and_a_gemm_without_wmma():
    text = " v_fma_f32 v0, v1, v2, v3\n .wavefront_size: 64\n .private_segment_fixed_size: 0\n"
    problems = " ".join(triton_isa.inspect("gate_up_kernel", "", text).problems)
    assert "wave32" in problems and "WMMA" in problems
    assert triton_isa.inspect("combine_kernel", "", text.replace("64", "32")).problems == ()


def _layer_compiles(arch: str) -> bool:
    """Whether the launches of one small decode call (the routing, gate_up, down, the combine) compile for arch."""
    try:
        _compile_call(TritonExperts(triton_isa.layer(8), "silu", torch.device("cpu"), amd=True), arch, 2, 1)
    except RuntimeError:  # the compiler's pass manager, as for the probe
        return False
    return True


def test_compile_probe_answers_as_the_backend_kernels_do():
    """The probe TritonBackend runs on ROCm GPUs says what the backend's own kernels would meet: on RDNA2 (the V620s'
    gfx1030) the tests' Triton (3.9) compiles neither, so the backend refuses the GPU by name rather than fail at a
    layer's first call; Triton 3.6 (the GPU machine's) compiles both. gfx1100 compiles either way."""
    refusals = {}
    for arch in ("gfx1030", "gfx1100"):
        with triton_isa.compiling_for(arch):
            refusals[arch] = compile_refusal(torch.device("cpu"))
        assert (refusals[arch] is None) == _layer_compiles(arch), (arch, refusals[arch])
        assert refusals[arch] is None or f"does not compile for {arch}" in refusals[arch]
    assert refusals["gfx1100"] is None
