"""Checkpoint formats -> W4A16ExpertWeights for one MoE layer's local experts.

    config.json quantization_config --parse_quant_config--> CheckpointQuant
    per expert: gate, up, down projections --load_<format>--> Int4Weights [1, N, K]
    gate ++ up along N, experts stacked        -----------> W4A16ExpertWeights
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.formats.config import (
    COMPRESSED_TENSORS,
    DENSE,
    GPTQ,
    CheckpointQuant,
    FormatMismatch,
    parse_quant_config,
)
from kernels.formats.dense import load_dense
from kernels.formats.gptq import load_gptq
from kernels.formats.pack_quantized import load_pack_quantized
from kernels.formats.source import SafetensorsFiles, TensorSource
from kernels.quant import SYMMETRIC_ZERO, Int4Weights, UnsupportedQuantization, W4A16ExpertWeights

__all__ = [
    "CheckpointQuant",
    "ExpertKeys",
    "FormatMismatch",
    "SafetensorsFiles",
    "TensorSource",
    "UnsupportedQuantization",
    "load_expert_weights",
    "load_projection",
    "parse_quant_config",
]

Loader = Callable[[TensorSource, str, CheckpointQuant], Int4Weights]
_LOADERS: dict[str, Loader] = {GPTQ: load_gptq, COMPRESSED_TENSORS: load_pack_quantized, DENSE: load_dense}


@dataclass(frozen=True, slots=True)
class ExpertKeys:
    """Module prefixes of one expert's projections, e.g. `model.layers.3.mlp.experts.17.gate_proj`."""

    gate: str
    up: str
    down: str


def load_projection(source: TensorSource, prefix: str, quant: CheckpointQuant) -> Int4Weights:
    """One projection in the checkpoint's format; compressed-tensors `ignore`d modules quantize on load."""
    if quant.method == COMPRESSED_TENSORS and quant.is_ignored(prefix):
        return load_dense(source, prefix, quant)
    return _LOADERS[quant.method](source, prefix, quant)


def load_expert_weights(
    source: TensorSource, experts: Sequence[ExpertKeys], quant: CheckpointQuant
) -> W4A16ExpertWeights:
    """Local experts of one layer, in the order given, as W4A16ExpertWeights."""
    assert experts, "no experts to load"
    w13, w2 = [], []
    for keys in experts:
        gate = load_projection(source, keys.gate, quant)
        up = load_projection(source, keys.up, quant)
        w13.append(_concat_out(gate, up, keys.gate))
        w2.append(load_projection(source, keys.down, quant))
    return W4A16ExpertWeights(_stack(w13), _stack(w2))


def _concat_out(gate: Int4Weights, up: Int4Weights, name: str) -> Int4Weights:
    """[1, I, H] ++ [1, I, H] -> [1, 2I, H] along the output features."""
    if gate.group_size != up.group_size:
        raise UnsupportedQuantization(f"{name}: gate and up use groups {gate.group_size} and {up.group_size}")
    if (gate.g_idx is None) != (up.g_idx is None) or (
        gate.g_idx is not None and not torch.equal(gate.g_idx, up.g_idx)
    ):
        raise UnsupportedQuantization(f"{name}: gate and up have different act-order permutations")
    zeros = None
    if gate.zeros is not None or up.zeros is not None:
        zeros = torch.cat([_zeros_of(gate), _zeros_of(up)], dim=1)
    return Int4Weights(
        packed=torch.cat([gate.packed, up.packed], dim=1),
        scales=torch.cat([gate.scales, up.scales], dim=1),
        group_size=gate.group_size,
        zeros=zeros,
        g_idx=gate.g_idx,
    )


def _stack(parts: list[Int4Weights]) -> Int4Weights:
    """Experts of one projection, each [1, N, K], -> [E, N, K]."""
    first = parts[0]
    if any(p.group_size != first.group_size for p in parts):
        raise UnsupportedQuantization("experts of one layer use different group sizes")
    act_order = any(p.g_idx is not None for p in parts)
    asymmetric = any(p.zeros is not None for p in parts)
    return Int4Weights(
        packed=torch.cat([p.packed for p in parts]),
        scales=torch.cat([p.scales.float() for p in parts]),
        group_size=first.group_size,
        zeros=torch.cat([_zeros_of(p) for p in parts]) if asymmetric else None,
        g_idx=torch.cat([_g_idx_of(p) for p in parts]) if act_order else None,
    )


def _zeros_of(weights: Int4Weights) -> torch.Tensor:
    if weights.zeros is not None:
        return weights.zeros
    return torch.full(weights.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8)


def _g_idx_of(weights: Int4Weights) -> torch.Tensor:
    if weights.g_idx is not None:
        return weights.g_idx
    k = weights.in_features
    return (torch.arange(k, dtype=torch.int32) // weights.group_size).unsqueeze(0)
