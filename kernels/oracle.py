"""Picks the expert backend for a device, quantization scheme and activation.

Every backend is asked the three questions; the first in priority order that answers yes to
all is used. The choice and each refusal reason are logged. Forcing a backend by name
(`--kernel-backend NAME`) skips the priority order but not the questions: if the forced
backend cannot run, BackendUnavailable says why.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch

from kernels.backends.base import ExpertBackend, Support, is_rocm
from kernels.quant import QuantScheme

logger = logging.getLogger(__name__)

# name -> "module:class", imported only when asked (triton is not imported on a CPU worker)
BACKENDS = {
    "hip_fdot2": "kernels.backends.hip_fdot2:HipFdot2Backend",
    "triton": "kernels.backends.triton_moe:TritonBackend",
    "cpu": "kernels.backends.cpu:CpuBackend",
    "reference": "kernels.backends.reference:ReferenceBackend",
}


class BackendUnavailable(RuntimeError):
    """No backend (or not the forced one) can run this layer here; the message has every reason."""


@dataclass(frozen=True, slots=True)
class Choice:
    """The backend chosen and why each one before it was refused."""

    backend: ExpertBackend
    refusals: dict[str, str]


def create_backend(name: str) -> ExpertBackend:
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown kernel backend {name!r}; known: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def priority(device: torch.device) -> list[str]:
    """RDNA2 (gfx103x) has fdot2 and no WMMA: the HIP kernel first; elsewhere Triton leads."""
    if is_rocm(device):
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if arch.startswith("gfx103"):
            return ["hip_fdot2", "triton", "cpu", "reference"]
    return ["triton", "hip_fdot2", "cpu", "reference"]


def refusal(backend: ExpertBackend, device: torch.device, scheme: QuantScheme, activation: str) -> str | None:
    """None when `backend` can run the layer, else the first reason it cannot."""
    answers: list[Support] = [
        backend.supports_device(device),
        backend.supports_quant_scheme(scheme),
        backend.supports_activation(activation),
    ]
    for answer in answers:
        if not answer.ok:
            return answer.reason
    return None


def choose_backend(
    device: torch.device, scheme: QuantScheme, activation: str, forced: str | None = None
) -> Choice:
    """The backend to run a layer with `scheme` and `activation` on `device`."""
    names = [forced] if forced is not None else priority(device)
    refusals: dict[str, str] = {}
    for name in names:
        backend = create_backend(name)
        reason = refusal(backend, device, scheme, activation)
        if reason is None:
            logger.info(
                "kernel backend %r for %s, %s, %s%s", name, device, scheme.describe(), activation,
                " (forced)" if forced else "",
            )
            return Choice(backend, refusals)
        refusals[name] = reason
        logger.info("kernel backend %r refused: %s", name, reason)
    detail = "; ".join(f"{name}: {reason}" for name, reason in refusals.items())
    what = f"forced kernel backend {forced!r}" if forced else "no kernel backend"
    raise BackendUnavailable(f"{what} cannot run {scheme.describe()} / {activation} on {device}: {detail}")
