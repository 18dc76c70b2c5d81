"""Builds kernels/csrc/w4a16_fdot2.cu into a shared library with hipcc (AMD) or nvcc (NVIDIA),
and kernels/csrc/dense_experts.c (the workers' CPU kernel) with the host's C compiler.

A build records the GPU architectures it holds code for; `check_arch` refuses to run a build on
a device whose architecture it lacks (an AMD code object for gfx1030 does not run on gfx1100,
and the failure at launch is an opaque 'invalid device function').
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "w4a16_fdot2.cu"
# The host library: the dense experts' kernel and the shared-memory plane's serving loop that calls
# it (workers), and the partition and combine stages (the attention node).
HOST_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("dense_experts.c", "shm_serve.c", "stages.c"))
# For this CPU's vector units, and no floating-point contraction: a multiply and an add stay two
# rounded operations, so the kernel's bits do not depend on what the compiler fuses.
HOST_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
DEFAULT_CACHE = Path.home() / ".cache" / "hetero_moe" / "kernels"


class KernelBuildError(RuntimeError):
    """The compiler is missing or failed; the message holds its output."""


class KernelArchMismatch(RuntimeError):
    """A kernel build has no code for the device's architecture."""


@dataclass(frozen=True, slots=True)
class KernelBuild:
    library: Path
    platform: str  # "hip" or "cuda"
    archs: tuple[str, ...]  # gfx1030 / sm_90 ...


def device_platform() -> str:
    return "hip" if torch.version.hip is not None else "cuda"


def device_arch(device: torch.device) -> str:
    """gfx1030 (AMD, features stripped) or sm_90 (NVIDIA)."""
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def compiler(platform: str) -> str | None:
    """Path of hipcc / nvcc, or None."""
    if platform == "hip":
        return shutil.which("hipcc") or _existing("/opt/rocm/bin/hipcc")
    from torch.utils.cpp_extension import CUDA_HOME

    return shutil.which("nvcc") or (_existing(f"{CUDA_HOME}/bin/nvcc") if CUDA_HOME else None)


def _existing(path: str) -> str | None:
    return path if Path(path).exists() else None


def compile_command(platform: str, archs: tuple[str, ...], output: Path) -> list[str]:
    tool = compiler(platform)
    if tool is None:
        raise KernelBuildError(f"no {'hipcc' if platform == 'hip' else 'nvcc'} found to build {SOURCE.name}")
    common = ["-O3", "-std=c++17", "-shared", "-o", str(output), str(SOURCE)]
    if platform == "hip":
        # wave32: RDNA runs 32-lane waves natively; the kernel's warp reductions assume 32 lanes
        return [tool, "-x", "hip", "-fPIC", "-mno-wavefrontsize64", *(f"--offload-arch={a}" for a in archs), *common]
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    return [tool, "-Xcompiler", "-fPIC", *gencode, *common]


def build(platform: str, archs: tuple[str, ...], cache_dir: Path = DEFAULT_CACHE) -> KernelBuild:
    """Compiles (or reuses a cached build of) the fdot2 kernel for `archs`."""
    key = hashlib.sha256(SOURCE.read_bytes() + repr((platform, sorted(archs))).encode()).hexdigest()[:16]
    library = cache_dir / f"w4a16_fdot2_{platform}_{'_'.join(sorted(archs))}_{key}.so"
    env = {**os.environ, "HIP_PLATFORM": "amd"} if platform == "hip" else None
    _compile_once(library, lambda partial: compile_command(platform, archs, partial), env)
    return KernelBuild(library, platform, tuple(sorted(archs)))


def _compile_once(library: Path, command_for: Callable[[Path], list[str]], env: dict[str, str] | None = None) -> None:
    """Runs command_for(partial) unless `library` exists, then renames partial to it: atomic, so
    concurrent workers never load a half-written library."""
    if library.exists():
        return
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    command = command_for(partial)
    logger.info("building %s: %s", library.name, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    partial.rename(library)


def build_host(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Compiles (or reuses a cached build of) HOST_SOURCES into one library for this CPU: the cache
    key holds the CPU's model and features, as -march=native code may not run on another."""
    names = ", ".join(source.name for source in HOST_SOURCES)
    tool = shutil.which("cc") or shutil.which("gcc")
    if tool is None:
        raise KernelBuildError(f"no C compiler (cc or gcc) found to build {names}: install gcc")
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("model name", "flags"))]
    headers = sorted(HOST_SOURCES[0].parent.glob("*.h"))
    sources = b"".join(source.read_bytes() for source in (*HOST_SOURCES, *headers))
    key = hashlib.sha256(sources + repr((tool, HOST_FLAGS, cpu[:2])).encode()).hexdigest()[:16]
    library = cache_dir / f"hetero_moe_host_{key}.so"
    _compile_once(library, lambda partial: [tool, *HOST_FLAGS, "-o", str(partial), *map(str, HOST_SOURCES), "-lm",
                                            "-pthread"])  # fmt: skip
    return library


def load_host(library: Path) -> ctypes.CDLL:
    """The library with its functions typed (see their signatures in the sources)."""
    lib = ctypes.CDLL(str(library))
    pointer, size, code = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hm_dense_experts.restype = lib.hm_dense_frame.restype = ctypes.c_int
    lib.hm_dense_experts.argtypes = [pointer, size, size, size, size, pointer, pointer, code, pointer, pointer, pointer,
                                     size, pointer]  # fmt: skip
    lib.hm_dense_frame.argtypes = [pointer, code, size, size, size, size, size, size, pointer, pointer, code, pointer]
    lib.hm_tables_new.restype = pointer
    lib.hm_tables_new.argtypes = [size, size]
    lib.hm_tables_set.restype = lib.hm_tables_free.restype = None
    lib.hm_tables_set.argtypes = [pointer, pointer, size]
    lib.hm_tables_free.argtypes = [pointer]
    lib.hm_shm_serve.restype = code
    lib.hm_shm_serve.argtypes = [code, pointer, pointer, pointer, code]
    lib.hm_partition.restype = lib.hm_combine.restype = code
    lib.hm_partition.argtypes = [pointer, pointer, size, size, pointer, size, pointer, size, pointer, pointer, pointer,
                                 pointer, pointer]
    lib.hm_combine.argtypes = [pointer, code, size, size, size, pointer, pointer, pointer]
    lib.hm_shm_send_forward.restype = code
    lib.hm_shm_send_forward.argtypes = [code, pointer, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32,
                                        ctypes.c_uint32, pointer, size, size, ctypes.c_uint32, ctypes.c_uint16, pointer,
                                        size, pointer, size]  # fmt: skip
    return lib


@functools.cache
def host_library() -> ctypes.CDLL:
    """This process's host library, built at first use (build_host) and typed (load_host)."""
    return load_host(build_host())


def check_arch(kernel: KernelBuild, device: torch.device) -> None:
    """Raises KernelArchMismatch unless `kernel` holds code for `device`."""
    arch = device_arch(device)
    if arch not in kernel.archs:
        fix = f"--offload-arch={arch}" if kernel.platform == "hip" else f"-gencode for {arch}"
        raise KernelArchMismatch(
            f"{kernel.library.name} was built for {', '.join(kernel.archs)} but {device} is {arch}: rebuild with {fix}"
        )


def load(kernel: KernelBuild) -> ctypes.CDLL:
    """The library with `hm_fdot2_moe` and `hm_fdot2_workspace_floats` typed (see the signature in the source)."""
    lib = ctypes.CDLL(str(kernel.library))
    lib.hm_fdot2_moe.restype = ctypes.c_int
    lib.hm_fdot2_moe.argtypes = [ctypes.c_void_p] * 13 + [ctypes.c_int] * 8 + [ctypes.c_void_p]
    lib.hm_fdot2_workspace_floats.restype = ctypes.c_size_t
    lib.hm_fdot2_workspace_floats.argtypes = [ctypes.c_int] * 4
    return lib
