"""Fatbin guard: inspect the device ISA of the very library the hip_fdot2 backend loads.

HipFdot2Backend.build (native_build.build: one function, one flag set) compiles
kernels/csrc/w4a16_fdot2.cu into the library prepare loads; this module
cuts each AMD code object out of that library's offload bundle, disassembles it with the
llvm-objdump of the same hipcc's clang and reads its metadata with that llvm-readelf. gfx1030
(RDNA2, the expert pool) must use fdot2 (`v_dot2*_f32_f16`), run wave32, and contain no WMMA
instruction (RDNA2 has none: a WMMA there means the build targeted the wrong chip).

    python -m kernels.hip_isa [--arch gfx1030 --arch gfx1100] [--out DIR]
exits 1 when a target fails to build or breaks a rule.
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernels import native_build
from kernels.backends.hip_fdot2 import HipFdot2Backend
from kernels.native_build import KernelBuild, KernelBuildError

TARGETS = ("gfx1030", "gfx1100")
FDOT2 = re.compile(r"\bv_\w*dot2\w*_f32_f16")
RDNA2_FDOT2 = re.compile(r"\bv_dot2\w*_f32_f16")
WMMA = re.compile(r"\bv_wmma\w*")
WAVEFRONT_SIZE = re.compile(r"\.wavefront_size:\s+(\d+)")
BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


@dataclass(frozen=True, slots=True)
class IsaReport:
    arch: str
    fdot2_count: int
    wmma_count: int
    wave32: bool
    problems: tuple[str, ...]


def code_objects(library: Path) -> dict[str, bytes]:
    """arch -> AMD code object (ELF) from the library's clang offload bundle.

    Bundle: magic, uint64 entry count, then per entry uint64 offset (from the magic), size,
    triple length, and the triple (`hipv4-amdgcn-amd-amdhsa--gfx1030`).
    """
    data = library.read_bytes()
    base = data.find(BUNDLE_MAGIC)
    assert base >= 0, f"{library} holds no clang offload bundle"
    (count,) = struct.unpack_from("<Q", data, base + len(BUNDLE_MAGIC))
    cursor, objects = base + len(BUNDLE_MAGIC) + 8, {}
    for _ in range(count):
        offset, size, triple_len = struct.unpack_from("<QQQ", data, cursor)
        triple = data[cursor + 24 : cursor + 24 + triple_len].decode()
        cursor += 24 + triple_len
        if "amdgcn" in triple:
            objects[triple.rsplit("-", 1)[-1]] = data[base + offset : base + offset + size]
    return objects


def llvm_tool(name: str) -> str:
    """The `name` (llvm-objdump, llvm-readelf) that the build's hipcc clang resolves."""
    result = subprocess.run([_hipcc(), f"-print-prog-name={name}"], capture_output=True, text=True,
                            env={**os.environ, "HIP_PLATFORM": "amd"})  # fmt: skip
    path = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    if result.returncode != 0 or not Path(path).exists():
        raise KernelBuildError(f"hipcc's clang has no {name} ({result.returncode}): {result.stderr[-2000:]}")
    return path


def library_isa(kernel: KernelBuild, arch: str) -> str:
    """Disassembly and metadata notes of `arch`'s code object in the built library."""
    objects = code_objects(kernel.library)
    assert arch in objects, f"{kernel.library.name} holds code for {sorted(objects)}, not {arch}"
    with tempfile.NamedTemporaryFile(suffix=f"-{arch}.co") as co:
        co.write(objects[arch])
        co.flush()
        text = []
        for command in ([llvm_tool("llvm-objdump"), "-d", f"--mcpu={arch}", co.name],
                        [llvm_tool("llvm-readelf"), "--notes", co.name]):  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
            text.append(result.stdout)
    return "\n".join(text)


def inspect(arch: str, isa: str) -> IsaReport:
    """Applies the rules for `arch` to its disassembly and metadata."""
    fdot2 = len(FDOT2.findall(isa))
    wmma = len(WMMA.findall(isa))
    sizes = set(WAVEFRONT_SIZE.findall(isa))
    wave32 = sizes == {"32"}
    problems = []
    if not wave32:
        problems.append(f"kernels are not all wave32 (wavefront sizes {sorted(sizes) or 'none found'})")
    if arch.startswith("gfx103"):
        if not RDNA2_FDOT2.search(isa):
            problems.append("no v_dot2*_f32_f16 (fdot2) instruction in the RDNA2 build")
        if wmma:
            problems.append(f"{wmma} WMMA instructions in an RDNA2 build")
    return IsaReport(arch, fdot2, wmma, wave32, tuple(problems))


def _hipcc() -> str:
    tool = native_build.compiler("hip")
    if tool is None:
        raise KernelBuildError("hipcc is not installed (Debian: apt-get install hipcc; or ROCm in /opt/rocm)")
    return tool


def per_arch_command(argv: list[str] | None, doc: str, targets: tuple[str, ...], out_help: str,
                     check_arch: Callable[[str, Path | None], bool]) -> int:
    """The command line the ISA checks share: --arch (repeated; default every target) and --out DIR.
    check_arch(arch, out) prints its findings and returns whether arch failed; -> the exit status."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=targets, help="default: all")
    parser.add_argument("--out", type=Path, help=out_help)
    args = parser.parse_args(argv)
    failed = [check_arch(arch, args.out) for arch in args.arch or targets]
    return 1 if any(failed) else 0


def _check_library(arch: str, out: Path | None) -> bool:
    try:
        kernel = HipFdot2Backend().build("hip", (arch,))
        isa = library_isa(kernel, arch)
    except KernelBuildError as err:
        print(f"{arch}: FAIL {err}")
        return True
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{arch}.s").write_text(isa)
    report = inspect(arch, isa)
    status = "FAIL " + "; ".join(report.problems) if report.problems else "ok"
    print(f"{arch}: {status} (fdot2 instructions {report.fdot2_count}, wmma {report.wmma_count}, "
          f"wave32 {report.wave32}; {kernel.library})")
    return bool(report.problems)


def main(argv: list[str] | None = None) -> int:
    return per_arch_command(argv, __doc__, TARGETS, "write <arch>.s here", _check_library)


if __name__ == "__main__":
    sys.exit(main())
