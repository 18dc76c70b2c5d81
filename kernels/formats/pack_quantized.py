"""compressed-tensors `pack-quantized` int4 projections (llm-compressor's W4A16 output).

weight_packed [N, K/8] int32 holds q + 8 (nibble i of word j is k = 8j + i), weight_scale
[N, K/G], weight_shape [2]; asymmetric layers add weight_zero_point packed along N
([N/8, K/G]), group act-order adds weight_g_idx [K].
"""
from __future__ import annotations

import torch

from kernels.formats.config import CheckpointQuant, FormatMismatch
from kernels.formats.source import TensorSource, require
from kernels.quant import Int4Weights, UnsupportedQuantization, unpack_int4

TENSORS = ("weight_packed", "weight_scale", "weight_shape")


def load_pack_quantized(source: TensorSource, prefix: str, quant: CheckpointQuant) -> Int4Weights:
    """One pack-quantized projection `prefix` -> Int4Weights with one expert, [1, N, K]."""
    require(source, prefix, TENSORS, "compressed-tensors pack-quantized")
    if f"{prefix}.bias" in source:
        raise UnsupportedQuantization(f"{prefix}: expert bias is not supported")
    packed = source[f"{prefix}.weight_packed"]  # [N, K/8] int32
    scales = source[f"{prefix}.weight_scale"].float()  # [N, K/G]
    n, k = (int(v) for v in source[f"{prefix}.weight_shape"])
    if k % 8:
        raise UnsupportedQuantization(f"{prefix}: K={k} is not a multiple of 8 (padded packing)")
    if tuple(packed.shape) != (n, k // 8) or packed.dtype != torch.int32:
        raise FormatMismatch(
            f"{prefix}: weight_packed {tuple(packed.shape)} {packed.dtype} is not [N, K/8] int32 "
            f"for weight_shape ({n}, {k})"
        )
    group_size = k if quant.group_size == -1 else quant.group_size
    if tuple(scales.shape) != (n, k // group_size):
        raise FormatMismatch(f"{prefix}: weight_scale {tuple(scales.shape)} does not match [{n}, {k}], group {group_size}")

    zeros = None
    if f"{prefix}.weight_zero_point" in source:
        zero_words = source[f"{prefix}.weight_zero_point"]  # [ceil(N/8), K/G], packed along N
        zeros = unpack_int4(zero_words.t().contiguous())[:, :n].t().contiguous()  # [N, K/G] zp + 8
    g_idx = None
    if f"{prefix}.weight_g_idx" in source:
        g_idx = source[f"{prefix}.weight_g_idx"].to(torch.int32)  # [K]
        if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group_size):
            g_idx = None
    return Int4Weights(
        packed=packed.contiguous().unsqueeze(0),
        scales=scales.contiguous().unsqueeze(0),
        group_size=group_size,
        zeros=None if zeros is None else zeros.unsqueeze(0),
        g_idx=None if g_idx is None else g_idx.unsqueeze(0),
    )
