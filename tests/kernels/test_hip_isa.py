"""Fatbin guard: the HIP kernel compiled by Debian's hipcc for gfx1030 uses fdot2, wave32, no WMMA.

Skipped, with the reason, only when hipcc is not installed (`make test` installs it).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kernels import hip_isa

@pytest.fixture(scope="module")
def isa() -> dict[str, str]:
    """Device assembly per target, compiled once for the module (both targets at once)."""
    if hip_isa.hipcc() is None:
        pytest.skip("hipcc not installed (apt-get install hipcc)")
    with ThreadPoolExecutor(len(hip_isa.TARGETS)) as pool:
        return dict(zip(hip_isa.TARGETS, pool.map(hip_isa.device_isa, hip_isa.TARGETS)))


def test_gfx1030_uses_fdot2_wave32_and_no_wmma(isa):
    text = isa["gfx1030"]
    assert hip_isa.RDNA2_FDOT2.search(text), "no v_dot2*_f32_f16 in the gfx1030 ISA"
    assert not hip_isa.WMMA.search(text), "WMMA instruction in the gfx1030 ISA"
    assert hip_isa.WAVE32.search(text), "gfx1030 kernels are not wave32"
    assert hip_isa.inspect("gfx1030", text).problems == ()


def test_gfx1100_compiles_wave32(isa):
    report = hip_isa.inspect("gfx1100", isa["gfx1100"])
    assert report.wave32 and report.problems == ()
    assert report.fdot2_count > 0


def test_inspect_flags_a_build_without_fdot2():
    """The rules themselves: an RDNA2 build that lost fdot2 or gained WMMA is reported."""
    no_dot = ".amdhsa_kernel k\n v_fma_mix_f32 v1, v2, v3\n .amdhsa_wavefront_size32 1\n"
    assert "fdot2" in " ".join(hip_isa.inspect("gfx1030", no_dot).problems)
    wmma = ".amdhsa_kernel k\n v_dot2c_f32_f16_e32 v3, v1, v2\n v_wmma_f32_16x16x16_f16 v[0:7]\n .amdhsa_wavefront_size32 1\n"
    assert "WMMA" in " ".join(hip_isa.inspect("gfx1030", wmma).problems)
