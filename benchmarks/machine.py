"""What a CPU benchmark ran on, for its JSON: the host behind this machine kind can change between
sessions (on 2026-12-04 an AMD EPYC with AVX2 and no AVX-512; the earlier one was not recorded,
and vLLM's CPU attention for bench-pingpong's batch took about 5x longer on this one), so figures
from different dates compare only with the CPU beside them."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name and the widest vector ISA vLLM's CPU kernels pick from."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    fields: dict[str, str] = {}
    for line in info.split("\n\n")[0].splitlines():  # the first CPU's block
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    name = fields.get("model name", "unknown CPU")
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "no avx2")
    return f"{name} ({isa})"


def describe(loopback: bool = True) -> str:
    """e.g. 'x86_64, AMD EPYC (avx2), 2 cores, CPU only, loopback'."""
    return f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} cores, CPU only" + (", loopback" if loopback else "")
