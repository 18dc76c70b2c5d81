"""Fatbin guard: the library HipFdot2Backend loads, built by its own `build` call for gfx1030,
uses fdot2, wave32 and no WMMA. The ISA is read out of that very .so, not out of a separate compile.

Skipped, with the reason, only when hipcc is not installed (`make test` installs it).
"""
from __future__ import annotations

import pytest

from kernels import hip_isa, native_build
from kernels.backends.hip_fdot2 import HipFdot2Backend
from kernels.native_build import KernelBuildError


def _build(arch: str, cache_dir) -> native_build.KernelBuild:
    if native_build.compiler("hip") is None:
        pytest.skip("hipcc not installed (apt-get install hipcc)")
    return HipFdot2Backend(cache_dir=cache_dir).build("hip", (arch,))  # prepare's own call


@pytest.fixture(scope="module")
def gfx1030(tmp_path_factory) -> tuple[native_build.KernelBuild, str]:
    kernel = _build("gfx1030", tmp_path_factory.mktemp("kernels"))
    return kernel, hip_isa.library_isa(kernel, "gfx1030")


def test_gfx1030_library_uses_fdot2_wave32_and_no_wmma(gfx1030):
    kernel, text = gfx1030
    assert kernel.archs == ("gfx1030",) and kernel.library.exists()
    assert hip_isa.RDNA2_FDOT2.search(text), "no v_dot2*_f32_f16 in the gfx1030 library"
    assert not hip_isa.WMMA.search(text), "WMMA instruction in the gfx1030 library"
    assert hip_isa.inspect("gfx1030", text).wave32, "gfx1030 kernels are not wave32"
    assert hip_isa.inspect("gfx1030", text).problems == ()


def test_gfx1100_library_compiles_wave32(tmp_path):
    try:
        kernel = _build("gfx1100", tmp_path)
    except KernelBuildError as err:
        if "cannot find ROCm device library for gfx1100" in str(err):
            pytest.skip("this ROCm (Debian's 5.2) has no gfx1100 device library: the library cannot link")
        raise
    report = hip_isa.inspect("gfx1100", hip_isa.library_isa(kernel, "gfx1100"))
    assert report.wave32 and report.problems == ()
    assert report.fdot2_count > 0


def test_inspect_flags_a_build_without_fdot2():
    """The rules themselves: an RDNA2 build that lost fdot2, gained WMMA or left wave32 is reported."""
    no_dot = " v_fma_mix_f32 v1, v2, v3\n .wavefront_size: 32\n"
    assert "fdot2" in " ".join(hip_isa.inspect("gfx1030", no_dot).problems)
    wmma = " v_dot2c_f32_f16_e32 v3, v1, v2\n v_wmma_f32_16x16x16_f16 v[0:7]\n .wavefront_size: 32\n"
    assert "WMMA" in " ".join(hip_isa.inspect("gfx1030", wmma).problems)
    wave64 = " v_dot2c_f32_f16_e32 v3, v1, v2\n .wavefront_size: 32\n .wavefront_size: 64\n"
    assert "wave32" in " ".join(hip_isa.inspect("gfx1030", wave64).problems)
