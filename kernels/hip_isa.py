"""Fatbin guard: compile the HIP kernel for AMD targets with hipcc and inspect the device ISA.

gfx1030 (RDNA2, the expert pool) must use fdot2 (`v_dot2*_f32_f16`), run wave32, and contain no
WMMA instruction (RDNA2 has none: a WMMA there means the build targeted the wrong chip). gfx1100
is compiled with -nogpulib (Debian's ROCm 5.2 device libraries stop at gfx10), assembly only.

    python -m kernels.hip_isa [--arch gfx1030 --arch gfx1100] [--out DIR]
exits 1 when a target fails to compile or breaks a rule.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kernels.native_build import SOURCE

TARGETS = {
    "gfx1030": [],
    "gfx1100": ["-nogpulib"],
}
FDOT2 = re.compile(r"\bv_\w*dot2\w*_f32_f16")
RDNA2_FDOT2 = re.compile(r"\bv_dot2\w*_f32_f16")
WMMA = re.compile(r"\bv_wmma\w*")
WAVE32 = re.compile(r"\.amdhsa_wavefront_size32\s+1\b")


class IsaCompileError(RuntimeError):
    """hipcc is missing or failed to compile the kernel for a target."""


@dataclass(frozen=True, slots=True)
class IsaReport:
    arch: str
    fdot2_count: int
    wmma_count: int
    wave32: bool
    problems: tuple[str, ...]


def hipcc() -> str | None:
    return shutil.which("hipcc")


def device_isa(arch: str, source: Path = SOURCE) -> str:
    """The device assembly hipcc writes for `arch`."""
    tool = hipcc()
    if tool is None:
        raise IsaCompileError("hipcc is not installed (Debian: apt-get install hipcc)")
    command = [
        tool, "-x", "hip", f"--offload-arch={arch}", "-O3", "-mno-wavefrontsize64",
        *TARGETS.get(arch, []), "--cuda-device-only", "-S", "-o", "-", str(source),
    ]
    # HIP_PLATFORM=amd: hipcc would pick nvcc on a machine that has CUDA installed
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"})
    if result.returncode != 0 or ".amdhsa_kernel" not in result.stdout:
        raise IsaCompileError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def inspect(arch: str, isa: str) -> IsaReport:
    """Applies the rules for `arch` to its assembly."""
    fdot2 = len(FDOT2.findall(isa))
    wmma = len(WMMA.findall(isa))
    wave32 = bool(WAVE32.search(isa)) and not re.search(r"\.amdhsa_wavefront_size32\s+0\b", isa)
    problems = []
    if not wave32:
        problems.append("kernels are not wave32")
    if arch.startswith("gfx103"):
        if not RDNA2_FDOT2.search(isa):
            problems.append("no v_dot2*_f32_f16 (fdot2) instruction in the RDNA2 build")
        if wmma:
            problems.append(f"{wmma} WMMA instructions in an RDNA2 build")
    return IsaReport(arch, fdot2, wmma, wave32, tuple(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=sorted(TARGETS), help="default: all")
    parser.add_argument("--out", type=Path, help="write <arch>.s here")
    args = parser.parse_args(argv)
    failed = False
    for arch in args.arch or sorted(TARGETS):
        try:
            isa = device_isa(arch)
        except IsaCompileError as err:
            print(f"{arch}: FAIL {err}")
            failed = True
            continue
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{arch}.s").write_text(isa)
        report = inspect(arch, isa)
        status = "FAIL " + "; ".join(report.problems) if report.problems else "ok"
        print(f"{arch}: {status} (fdot2 instructions {report.fdot2_count}, wmma {report.wmma_count}, wave32 {report.wave32})")
        failed |= bool(report.problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
