"""The contract every expert backend implements, and the answers the oracle reads.

    backend.supports_device / supports_quant_scheme / supports_activation -> Support
    backend.prepare(weights, activation, device) -> PreparedExperts   (repack once per layer)
    prepared(hidden, pair_rows, pair_experts, pair_weights)  -> [T, H] float32

`prepared(...)` computes exactly what kernels.reference.moe_experts_w4a16_reference does.
"""
from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.quant import QuantScheme, W4A16ExpertWeights

from kernels.activations import ACTIVATION_NAMES as ACTIVATIONS


def is_rocm(device: torch.device) -> bool:
    """Whether `device` is an AMD GPU (torch's ROCm build names it cuda)."""
    return device.type == "cuda" and torch.version.hip is not None


@dataclass(frozen=True, slots=True)
class Support:
    """A backend's answer to one question; `reason` says why not (or what it will do)."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls, reason: str = "") -> Support:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


def symmetric_int4_support(scheme: QuantScheme, group_sizes: Sequence[int]) -> Support:
    """The schemes the int4 kernels run: symmetric (zero 8), no act-order, one of `group_sizes`."""
    if scheme.bits != 4 or not scheme.symmetric:
        return Support.no(f"{scheme.describe()}: the kernel hard-codes zero 8 (symmetric int4)")
    if scheme.act_order:
        return Support.no(f"{scheme.describe()}: act-order g_idx is not supported")
    if scheme.group_size not in group_sizes:
        return Support.no(f"{scheme.describe()}: group size must be one of {tuple(group_sizes)}")
    return Support.yes()


@dataclass(frozen=True, slots=True)
class FrameKernel:
    """A C function that computes a request straight from its FORWARD frame's bytes (protos/frames.py),
    with hm_dense_frame's signature and return codes (kernels/csrc/dense_experts.c), and the arguments
    that name one set of experts. The worker calls it from Python (PreparedExperts.forward_frame)
    and from the shared-memory plane's serving loop in C (kernels/csrc/shm_serve.c)."""

    function: ctypes._CFuncPtr  # typed as in native_build.load_host
    w13t: int  # addresses of the set's weight tables
    w2t: int
    hidden: int
    intermediate: int
    num_experts: int
    activation: int  # kernels.activations.ACTIVATION_CODES

    def __call__(self, payload: int, dtype: int, rows: int, pairs: int, first: int, out: int) -> bool:
        """PreparedExperts.forward_frame's contract; MemoryError when the kernel had no memory."""
        status = self.function(payload, dtype, rows, self.hidden, pairs, first, self.intermediate, self.num_experts,
                               self.w13t, self.w2t, self.activation, out)  # fmt: skip
        if status == -2:
            raise MemoryError("no memory for a request's scratch buffers in its frame kernel")
        return status == 0


class PreparedExperts(ABC):
    """One layer's experts, repacked for a backend and resident on its device."""

    @abstractmethod
    def __call__(
        self,
        hidden: torch.Tensor,
        pair_rows: torch.Tensor,
        pair_experts: torch.Tensor,
        pair_weights: torch.Tensor,
        *,
        rows_ascending: bool = False,
    ) -> torch.Tensor:
        """hidden [T, H] float, pair_rows/pair_experts [P] int, pair_weights [P] float -> [T, H] float32.

        rows_ascending: the caller's promise that pair_rows never decrease (a hint: a backend that groups
        the pairs by row may skip that sort; the result is the same either way)."""

    def forward_frame(self, payload: int, dtype: int, rows: int, pairs: int, first: int, out: int) -> bool:
        """A FORWARD frame's request computed from the frame's bytes (protos/frames.py; payload:
        their address, dtype: the wire dtype of its rows) into the [rows, H] float32 at address
        `out`, with the bits __call__ gives; `first`: the global id of this set's expert 0. False,
        computing nothing, for a request it does not take (none, by default): the worker then
        decodes the frame into tensors, checks them and calls the experts."""
        kernel = self.frame_kernel()
        return kernel is not None and kernel(payload, dtype, rows, pairs, first, out)

    def frame_kernel(self) -> FrameKernel | None:
        """The C function behind forward_frame, for a caller in C; None (the default): there is none."""
        return None


class ExpertBackend(ABC):
    """One way to compute routed experts; `name` is what `--kernel-backend` and Info report."""

    name: ClassVar[str]

    @abstractmethod
    def supports_device(self, device: torch.device) -> Support: ...

    @abstractmethod
    def supports_quant_scheme(self, scheme: QuantScheme) -> Support: ...

    def supports_activation(self, activation: str) -> Support:
        if activation in ACTIVATIONS:
            return Support.yes()
        return Support.no(f"activation {activation!r} is not one of {ACTIVATIONS}")

    @abstractmethod
    def prepare(
        self, weights: W4A16ExpertWeights, activation: str, device: torch.device
    ) -> PreparedExperts: ...


@dataclass(frozen=True, slots=True)
class PairsByExpert:
    """Pairs grouped by expert: expert e owns pairs order[bounds[e]:bounds[e+1]].

    order:  [P] int32 pair indices, stable within an expert
    bounds: [E+1] int32
    """

    order: torch.Tensor
    bounds: torch.Tensor

    @classmethod
    def group(cls, pair_experts: torch.Tensor, num_experts: int) -> PairsByExpert:
        """Device-side only: no host synchronisation."""
        return cls(*_stable_groups(pair_experts, num_experts))


@dataclass(frozen=True, slots=True)
class PairsByRow:
    """Pairs grouped by row: row t owns pairs order[bounds[t]:bounds[t+1]], ascending.

    order:  [P] int32 pair indices
    bounds: [T+1] int32
    """

    order: torch.Tensor
    bounds: torch.Tensor

    @classmethod
    def group(cls, pair_rows: torch.Tensor, num_rows: int) -> PairsByRow:
        """Device-side only: no host synchronisation."""
        return cls(*_stable_groups(pair_rows, num_rows))


def _stable_groups(keys: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [P] in [0, num_groups) -> (order [P] int32, stable within a group; bounds [G+1] int32)."""
    sorted_keys, order = torch.sort(keys, stable=True)  # [P], [P]
    groups = torch.arange(num_groups + 1, device=keys.device, dtype=sorted_keys.dtype)
    bounds = torch.searchsorted(sorted_keys, groups)  # [G+1]
    return order.to(torch.int32), bounds.to(torch.int32)
