"""W4A16 weight containers: int4 weights, group scales, per-layer experts.

One canonical layout is shared by every loader and backend; backends repack it once
when a layer is prepared. Shape legend: E experts, N output features, K input
features, G group size (input columns sharing one scale), I intermediate, H hidden.

Value of weight (e, n, k):  w = (q - zero) * scale[e, n, g_idx[k]]
  q     = nibble k % 8 of packed[e, n, k // 8], in 0..15 (compressed-tensors order)
  zero  = 8 (symmetric) or zeros[e, n, g] (asymmetric, 0..15)
  g_idx = k // G, or a checkpoint's act-order permutation
Scales keep their sign: GPTQ writers (auto-round) store negative scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NIBBLES_PER_WORD = 8
SYMMETRIC_ZERO = 8


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization that no path here computes correctly."""


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """What a backend must implement to run a layer; backends answer from this alone."""

    bits: int
    group_size: int
    symmetric: bool
    act_order: bool

    def describe(self) -> str:
        sym = "sym" if self.symmetric else "asym"
        order = ", act-order" if self.act_order else ""
        return f"int{self.bits} {sym} group {self.group_size}{order}"


@dataclass(frozen=True, slots=True)
class Int4Weights:
    """One projection of E experts, logically [E, N, K].

    packed: [E, N, K/8] int32
    scales: [E, N, K/G] float (any float dtype, signed)
    zeros:  [E, N, K/G] uint8 in 0..15, or None when symmetric (zero 8)
    g_idx:  [E, K] int32 group of each input column, or None for k // G
    """

    packed: torch.Tensor
    scales: torch.Tensor
    group_size: int
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        e, n, words = self.packed.shape
        k = words * NIBBLES_PER_WORD
        assert self.packed.dtype == torch.int32, "packed int4 must be int32 words"
        assert self.scales.is_floating_point(), "scales must be float"
        assert k % self.group_size == 0, f"K={k} is not a multiple of group {self.group_size}"
        assert self.scales.shape == (e, n, k // self.group_size), (
            f"scales {tuple(self.scales.shape)} do not match weights [E={e}, N={n}, K={k}] "
            f"with group {self.group_size}"
        )
        if self.zeros is not None:
            assert self.zeros.shape == self.scales.shape, "zeros and scales differ in shape"
        if self.g_idx is not None:
            assert self.g_idx.shape == (e, k), f"g_idx must be [E, K]=[{e}, {k}]"

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]

    @property
    def in_features(self) -> int:
        return self.packed.shape[2] * NIBBLES_PER_WORD

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(
            bits=4,
            group_size=self.group_size,
            symmetric=self.zeros is None,
            act_order=self.g_idx is not None,
        )

    def to(self, device: torch.device | str) -> Int4Weights:
        return Int4Weights(
            self.packed.to(device),
            self.scales.to(device),
            self.group_size,
            _to(self.zeros, device),
            _to(self.g_idx, device),
        )

    def unpacked(self, expert: int) -> torch.Tensor:
        """[N, K] uint8 nibbles of one expert."""
        return unpack_int4(self.packed[expert])

    def dequantize(self, expert: int) -> torch.Tensor:
        """[N, K] float32 weights of one expert."""
        q = self.unpacked(expert).float()  # [N, K]
        k = self.in_features
        groups = (
            torch.arange(k, device=q.device) // self.group_size
            if self.g_idx is None
            else self.g_idx[expert].long()
        )  # [K]
        scale = self.scales[expert].float()[:, groups]  # [N, K]
        zero = (
            torch.full_like(scale, SYMMETRIC_ZERO)
            if self.zeros is None
            else self.zeros[expert].float()[:, groups]
        )
        return (q - zero) * scale


@dataclass(frozen=True, slots=True)
class W4A16ExpertWeights:
    """One MoE layer's local experts, quantized (the int4 twin of DenseExpertWeights).

    w13: [E, 2I, H], gate rows then up rows
    w2:  [E, H, I]
    """

    w13: Int4Weights
    w2: Int4Weights

    def __post_init__(self) -> None:
        assert self.w13.num_experts == self.w2.num_experts, "w13 and w2 hold different expert counts"
        assert self.w13.out_features == 2 * self.w2.in_features, "w13 is not [E, 2I, H] for w2 [E, H, I]"
        assert self.w13.in_features == self.w2.out_features, "w13 and w2 disagree on H"
        if self.w13.scheme != self.w2.scheme:
            raise UnsupportedQuantization(
                f"w13 is {self.w13.scheme.describe()} but w2 is {self.w2.scheme.describe()}: "
                "one scheme per layer is supported"
            )

    @property
    def num_experts(self) -> int:
        return self.w13.num_experts

    @property
    def hidden_size(self) -> int:
        return self.w13.in_features

    @property
    def intermediate_size(self) -> int:
        return self.w2.in_features

    @property
    def scheme(self) -> QuantScheme:
        return self.w13.scheme

    def to(self, device: torch.device | str) -> W4A16ExpertWeights:
        return W4A16ExpertWeights(self.w13.to(device), self.w2.to(device))


def _to(tensor: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., K] integers in 0..15 -> [..., K/8] int32, nibble i of word j = q[8j + i]."""
    assert q.shape[-1] % NIBBLES_PER_WORD == 0, f"K={q.shape[-1]} is not a multiple of 8"
    assert int(q.min()) >= 0 and int(q.max()) <= 15, "int4 values must be in 0..15"
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)  # [8]
    words = (q.to(torch.int64).unflatten(-1, (-1, NIBBLES_PER_WORD)) << shifts).sum(-1)  # [..., K/8]
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement in int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/8] int32 -> [..., K] uint8 in 0..15 (inverse of pack_int4)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)  # [8]
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., K/8, 8]
    return nibbles.flatten(-2).to(torch.uint8)


def quantize_symmetric(weight: torch.Tensor, group_size: int) -> Int4Weights:
    """Round-to-nearest symmetric int4 of [E, N, K] float weights, one scale per group.

    scale = absmax / 7.5 per group (the compressed-tensors / GPTQ choice), q = round(w / scale) + 8
    clamped to 0..15; scales are float32.
    """
    e, n, k = weight.shape
    if k % group_size != 0:
        raise UnsupportedQuantization(f"K={k} is not a multiple of group {group_size}")
    w = weight.float().unflatten(-1, (k // group_size, group_size))  # [E, N, K/G, G]
    scales = w.abs().amax(-1) / 7.5  # [E, N, K/G]
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(w / scales.unsqueeze(-1)).clamp(-8, 7) + SYMMETRIC_ZERO  # [E, N, K/G, G]
    return Int4Weights(pack_int4(q.flatten(-2).to(torch.uint8)), scales, group_size)
