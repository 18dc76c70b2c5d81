"""Runtime guard: a kernel build without the device's architecture is refused with a message."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import native_build
from kernels.native_build import KernelArchMismatch, KernelBuild


def test_build_lacking_the_device_arch_is_refused(monkeypatch):
    monkeypatch.setattr(native_build, "device_arch", lambda device: "gfx1100")
    build = KernelBuild(Path("w4a16_fdot2_hip_gfx1030.so"), "hip", ("gfx1030",))
    with pytest.raises(KernelArchMismatch, match=r"built for gfx1030 but .* is gfx1100: rebuild with --offload-arch=gfx1100"):
        native_build.check_arch(build, torch.device("cuda", 0))


def test_build_with_the_device_arch_is_accepted(monkeypatch):
    monkeypatch.setattr(native_build, "device_arch", lambda device: "gfx1030")
    build = KernelBuild(Path("w4a16_fdot2_hip_gfx1030_gfx1100.so"), "hip", ("gfx1030", "gfx1100"))
    native_build.check_arch(build, torch.device("cuda", 0))


def test_hip_compile_command_targets_every_arch_wave32():
    if native_build.compiler("hip") is None:
        pytest.skip("hipcc not installed (apt-get install hipcc)")
    command = native_build.compile_command("hip", ("gfx1030", "gfx1100"), Path("out.so"))
    assert "--offload-arch=gfx1030" in command and "--offload-arch=gfx1100" in command
    assert "-mno-wavefrontsize64" in command
